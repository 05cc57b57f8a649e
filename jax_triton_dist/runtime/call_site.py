"""Call sites: what a traced ``triton_call`` launches, and its per-team state.

A call site is created when ``triton_call`` is traced and identified in the HLO
by an integer attribute. At run time each device's thread looks the site up,
joins its team (the devices that share every mesh coordinate but the kernel's
axis), and runs the kernel. The first run of a team allocates its symmetric
region (workspaces, barrier counters, staging for symmetric arguments) once;
later runs only count epochs, with no synchronisation between ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_triton_dist import shmem
from jax_triton_dist.shmem import heap, lifetime
from jax_triton_dist.shmem.settings import aligned

__all__ = ["ArraySpec", "CallSite", "TeamState", "allocate_region", "local_pes", "find",
           "lookup", "register"]


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """Shape and dtype of one per-rank buffer."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclasses.dataclass
class TeamState:
    """The ranks of one team at one call site, and their symmetric region."""

    pes: list[int | None]
    generation: int  # SHMEM generation the region belongs to
    region: Any = None  # the backend's description of the team's symmetric region
    name: str = ""  # teams across processes: the name of their rendezvous
    epochs: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.region is not None


@dataclasses.dataclass
class CallSite:
    """A traced ``triton_call``.

    Attributes:
      kernel: the ``@triton.jit`` kernel.
      label: kernel name for messages.
      grid: program counts.
      mesh_axes: every manual mesh axis, in mesh order (their indices are operand 0).
      axis: position of the kernel's axis in ``mesh_axes``.
      num_ranks: size of the kernel's axis.
      params: positional kernel arguments: ``("array", index)`` for an operand,
        ``("scalar", value)``, ``("output", index)``, ``("workspace", index)``.
      inputs: per-rank operand specs; ``symmetric`` marks those staged into the heap.
      outputs: per-rank result specs.
      workspaces: per-rank symmetric workspace specs.
      kwargs: keyword (constexpr) arguments.
      options: compiled backends' compile options (``num_warps``, ``num_stages``).
    """

    kernel: Any
    label: str
    grid: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    axis: int
    num_ranks: int
    params: list[tuple[str, Any]]
    inputs: list[ArraySpec]
    symmetric: frozenset[int]
    outputs: list[ArraySpec]
    workspaces: list[ArraySpec]
    kwargs: dict[str, Any]
    options: dict[str, int] = dataclasses.field(default_factory=dict)
    teams: dict[tuple[int, ...], TeamState] = dataclasses.field(default_factory=dict)
    cond: threading.Condition = dataclasses.field(default_factory=threading.Condition)

    # -- symmetric region layout: [barrier counters | workspaces | staging x2] --

    @functools.cached_property
    def region_layout(self) -> tuple[int, list[int], dict[int, tuple[int, int]], int]:
        """Offsets inside the region: barrier area, workspaces, staging slots; total size."""
        cursor = aligned(8 * self.num_ranks)
        workspace_offsets = []
        for spec in self.workspaces:
            workspace_offsets.append(cursor)
            cursor += aligned(spec.nbytes)
        staging = {}
        for index in sorted(self.symmetric):
            size = aligned(self.inputs[index].nbytes)
            staging[index] = (cursor, cursor + size)
            cursor += 2 * size
        return 0, workspace_offsets, staging, cursor

    def join(self, coords: tuple[int, ...], pe: int, timeout: float,
             allocate: Callable[[CallSite, TeamState], Any]) -> tuple[int, TeamState]:
        """Registers ``pe`` in its team; the first run waits for every rank of the team.

        The last rank to arrive calls ``allocate(site, team)`` (with every rank's PE known)
        and stores its result as ``team.region``.

        Returns:
          This PE's rank and the (ready) team state.
        """
        rank = coords[self.axis]
        key = coords[: self.axis] + coords[self.axis + 1:]
        with self.cond:
            team = self.teams.get(key)
            if team is None or team.generation != lifetime.generation():
                # First run, or SHMEM was re-initialised since: start over.
                team = TeamState(pes=[None] * self.num_ranks, generation=lifetime.generation())
                self.teams[key] = team
            if team.pes[rank] is None:
                team.pes[rank] = pe
            elif team.pes[rank] != pe:
                raise RuntimeError(
                    f"kernel {self.label}: rank {rank} of team {key} ran on PE {team.pes[rank]} "
                    f"before and now on PE {pe}: a traced call site cannot move between device "
                    "layouts; trace the function again for the new mesh"
                )
            if not team.ready and all(p is not None for p in team.pes):
                team.region = allocate(self, team)
                self.cond.notify_all()
            deadline = time.monotonic() + timeout
            while not team.ready:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [r for r, p in enumerate(team.pes) if p is None]
                    raise shmem.ShmemTimeoutError(
                        f"kernel {self.label}: rank {rank} (PE {pe}) waited {timeout:.1f} s for "
                        f"the first run of its team; ranks {missing} never arrived"
                    )
                self.cond.wait(remaining)
        return rank, team


    def join_processes(self, coords: tuple[int, ...], pe: int, name: str,
                       gather: Callable[[str, int, int, int], list[int]],
                       allocate: Callable[[CallSite, TeamState], Any]) -> tuple[int, TeamState]:
        """:meth:`join` for teams whose ranks live in different processes (one PE per
        process): the ranks swap their PEs through ``gather(name, members, index, value)``
        (a cross-process all-gather; ``name`` identifies the call site in every process),
        then each process calls ``allocate(site, team)``, which must agree with the other
        processes through ``gather`` too.
        """
        rank = coords[self.axis]
        key = coords[: self.axis] + coords[self.axis + 1:]
        with self.cond:
            team = self.teams.get(key)
            if team is None or team.generation != lifetime.generation():
                team_name = f"{name}/team{'-'.join(map(str, key))}"
                pes = gather(f"{team_name}/pes", self.num_ranks, rank, pe)
                team = TeamState(pes=pes, generation=lifetime.generation(), name=team_name)
                team.region = allocate(self, team)
                self.teams[key] = team
        return rank, team


def local_pes(team: TeamState) -> list[int]:
    """The team's PEs whose memory this process initialises (all, in one process)."""
    mine = heap.process_pe()
    return list(team.pes) if mine < 0 else [pe for pe in team.pes if pe == mine]


def allocate_region(site: CallSite, team: TeamState, extra: int = 0) -> int:
    """The team's symmetric region (``site.region_layout`` plus ``extra`` bytes): one
    offset reserved in every PE heap, zeroed on the team's members (those of this
    process). Returns the offset."""
    _, _, _, total = site.region_layout
    total = aligned(total) + extra
    offset = heap.reserve(total, f"kernel {site.label}'s workspaces")
    for pe in local_pes(team):
        heap.memset(pe, heap.heap_base(pe) + offset, 0, total)
    return offset


_sites: dict[int, CallSite] = {}
_ids = itertools.count(1)
_lock = threading.Lock()


def register(site: CallSite) -> int:
    """Stores ``site``; returns its id (the custom call's ``call_id`` attribute)."""
    with _lock:
        call_id = next(_ids)
        _sites[call_id] = site
    return call_id


def find(call_id: int) -> CallSite | None:
    """The call site of ``call_id``, or None."""
    return _sites.get(call_id)


def lookup(call_id: int) -> CallSite:
    """The call site of ``call_id``."""
    site = find(call_id)
    if site is None:
        raise RuntimeError(f"unknown jax_triton_dist call site {call_id}")
    return site

