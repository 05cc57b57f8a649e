"""Teams: strided subsets of the PEs with their own numbering and collectives."""

from __future__ import annotations

import itertools
import threading

from jax_triton_dist import _shmem as _lib
from jax_triton_dist.shmem.pes import my_pe, n_pes
from jax_triton_dist.shmem.rendezvous import WORLD_KEY, gather

__all__ = ["Team", "TEAM_WORLD", "team_split_strided", "team_my_pe", "team_n_pes",
           "team_translate_pe", "team_sync", "team_destroy"]

ShmemError = _lib.ShmemError


class Team:
    """A strided subset of PEs: ``start, start + stride, ...`` (``size`` of them).

    Team objects come from :func:`team_split_strided`; :data:`TEAM_WORLD` holds every PE
    (its size is that of the running instance).
    """

    def __init__(self, key: int, start: int, stride: int, size: int | None):
        self.key, self.start, self.stride = key, start, stride
        self._size = size  # None: every PE of the running instance
        self.destroyed = False

    @property
    def size(self) -> int:
        """Number of members."""
        return n_pes() if self._size is None else self._size

    def pes(self) -> list[int]:
        """Global PE numbers of the members, in team order."""
        return [self.start + i * self.stride for i in range(self.size)]

    def index_of(self, pe: int) -> int:
        """Team PE number of global ``pe``, or -1 if not a member."""
        offset = pe - self.start
        if offset < 0 or offset % self.stride:
            return -1
        index = offset // self.stride
        return index if index < self.size else -1

    def check(self) -> None:
        """Raises ShmemError if the team was destroyed."""
        if self.destroyed:
            raise ShmemError(f"team {self.key} was destroyed")

    def __repr__(self) -> str:
        size = "all" if self._size is None else self._size
        return f"Team(start={self.start}, stride={self.stride}, size={size})"


TEAM_WORLD = Team(WORLD_KEY, 0, 1, None)
"""Every PE."""

_keys = itertools.count(WORLD_KEY + 1)  # rendezvous keys of new teams, drawn by parent PE 0
_keys_lock = threading.Lock()


def _team_of(team: Team) -> Team:
    if not isinstance(team, Team):
        raise TypeError(f"expected a shmem.Team, got {type(team).__name__}")
    team.check()
    return team


def team_my_pe(team: Team) -> int:
    """The calling PE's number in ``team``, or -1 if it is not a member."""
    return _team_of(team).index_of(my_pe())


def team_n_pes(team: Team) -> int:
    """Number of PEs in ``team``."""
    return _team_of(team).size


def team_translate_pe(src_team: Team, src_pe: int, dest_team: Team) -> int:
    """Number in ``dest_team`` of PE ``src_pe`` of ``src_team``; -1 if not a member."""
    src, dest = _team_of(src_team), _team_of(dest_team)
    if not 0 <= src_pe < src.size:
        raise ValueError(f"team_translate_pe: src_pe {src_pe} is out of range 0..{src.size - 1}")
    return dest.index_of(src.pes()[src_pe])


def team_split_strided(parent: Team, start: int, stride: int, size: int) -> Team | None:
    """Collective over ``parent``: a new team of parent PEs ``start + i * stride``.

    Returns:
      The new team on its members, ``None`` on the other PEs of ``parent``.

    Raises:
      ValueError: the team does not fit in ``parent``.
      ShmemError: the PEs of ``parent`` passed different arguments.
    """
    parent = _team_of(parent)
    if size <= 0 or stride < 1 or start < 0 or start + (size - 1) * stride >= parent.size:
        raise ValueError(
            f"team_split_strided: start={start}, stride={stride}, size={size} does not fit in a "
            f"parent team of {parent.size} PEs")
    me = parent.index_of(my_pe())
    if me < 0:
        raise ShmemError(f"PE {my_pe()} is not a member of {parent!r}")
    signature = hash((start, stride, size)) & 0x7FFFFFFFFFFFFFFF
    seen = gather(parent.key, parent.size, me, signature, "shmem.team_split_strided")
    if len(set(seen)) != 1:
        raise ShmemError("team_split_strided is collective: the PEs of the parent team passed "
                         "different start/stride/size")
    # PE 0 of the parent draws the new team's rendezvous key; a second gather shares it.
    key = 0
    if me == 0:
        with _keys_lock:
            key = next(_keys)
    key = gather(parent.key, parent.size, me, key, "shmem.team_split_strided")[0]
    team = Team(key, parent.pes()[start], stride * parent.stride, size)
    return team if team.index_of(my_pe()) >= 0 else None


def team_sync(team: Team) -> None:
    """Collective barrier over the members of ``team``."""
    team = _team_of(team)
    me = team.index_of(my_pe())
    if me < 0:
        raise ShmemError(f"PE {my_pe()} is not a member of {team!r}")
    _lib.quiet(my_pe())
    gather(team.key, team.size, me, 0, "shmem.team_sync")


def team_destroy(team: Team) -> None:
    """Destroys ``team``; using it afterwards raises :class:`ShmemError`."""
    team = _team_of(team)
    if team is TEAM_WORLD:
        raise ShmemError("TEAM_WORLD cannot be destroyed")
    team.destroyed = True
