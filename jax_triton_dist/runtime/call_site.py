"""Call sites: what a traced ``triton_call`` launches, and its per-team state.

A call site is created when ``triton_call`` is traced and identified in the HLO
by an integer attribute. At run time each device's thread looks the site up,
joins its team (the devices that share every mesh coordinate but the kernel's
axes, and the same ``axis_index_groups`` group), and runs the kernel. The first
run of a team allocates its symmetric region (workspaces, barrier counters,
staging for symmetric arguments) once; later runs only count epochs, with no
synchronisation between ranks.

A site lives as long as an executable uses it (``runtime/site_uses.py`` follows XLA's
executables): :func:`release` then frees its regions and the backends' launch plans.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.metadata
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_triton_dist import shmem
from jax_triton_dist.language import timeline
from jax_triton_dist.runtime import python_ast, tuning
from jax_triton_dist.runtime.tuning import Autotuned, Variant
from jax_triton_dist.shmem import heap, lifetime, rendezvous
from jax_triton_dist.shmem.settings import aligned

__all__ = ["ArraySpec", "RegionLayout", "TeamAxes", "CallSite", "TeamState", "allocate_region",
           "local_pes", "find", "lookup", "register", "release", "on_release", "live_sites",
           "abandon_joins"]


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """Shape and dtype of one per-rank buffer."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class RegionLayout:
    """Byte offsets inside a call site's symmetric region (the same on every rank)."""

    barrier: int  # num_ranks uint64 counters of dl.barrier_all
    abort: int  # one int64: the highest epoch in which a rank of the team failed
    workspaces: list[int]
    staging: dict[int, tuple[int, int]]  # operand -> (slot of even epochs, of odd ones)
    total: int
    timeline: int = 0  # timed sites: the timeline area (language/timeline.py); else 0


@dataclasses.dataclass(frozen=True)
class TeamAxes:
    """Which devices of the mesh form one team, and each one's rank in it.

    Attributes:
      mesh_axes: every manual mesh axis, in mesh order (the call's operand 0 holds the
        device's coordinate along each).
      sizes: their sizes.
      axes: positions in ``mesh_axes`` of the team's axes, in the order the caller named
        them; a device's index over them is row-major in that order (the first named axis
        varies slowest), as for a multi-axis ``jax.lax.psum`` or ``all_gather``.
      groups: ``axis_index_groups``: the team is the group holding the device's index, and
        its rank is its position in that group; None: the team is every index.
    """

    mesh_axes: tuple[str, ...]
    sizes: tuple[int, ...]
    axes: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...] | None = None

    @property
    def num_ranks(self) -> int:
        """Ranks per team."""
        if self.groups is not None:
            return len(self.groups[0])
        return int(np.prod([self.sizes[a] for a in self.axes], dtype=np.int64))

    @functools.cached_property
    def _group_of(self) -> dict[int, tuple[int, int]]:
        return {index: (g, members.index(index)) for g, members in enumerate(self.groups or ())
                for index in members}

    def locate(self, coords: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """``(rank, team key)`` of the device at mesh coordinates ``coords``; devices with
        one key form one team."""
        index = 0
        for a in self.axes:
            index = index * self.sizes[a] + coords[a]
        key = tuple(c for i, c in enumerate(coords) if i not in self.axes)
        if self.groups is None:
            return index, key
        group, rank = self._group_of[index]
        return rank, key + (group,)


@dataclasses.dataclass
class TeamState:
    """The ranks of one team at one call site, and their symmetric region."""

    pes: list[int | None]
    generation: int  # SHMEM generation the region belongs to
    region: Any = None  # the backend's description of the team's symmetric region
    offset: int | None = None  # the region's heap offset (what release() frees)
    name: str = ""  # teams across processes: the name of their rendezvous
    epochs: dict[int, int] = dataclasses.field(default_factory=dict)  # PE -> last epoch
    run_bases: collections.OrderedDict[int, int] = dataclasses.field(
        default_factory=collections.OrderedDict)  # execution -> epoch its launches follow
    failures: dict[int, str] = dataclasses.field(default_factory=dict)  # epoch -> why
    choice: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> variant
    gathered: dict[str, list] = dataclasses.field(default_factory=dict)  # tag -> values
    locks: dict[int, threading.Lock] = dataclasses.field(default_factory=dict)  # rank -> lock

    @property
    def ready(self) -> bool:
        return self.region is not None

    def align_epoch(self, pe: int, run_id: int, lock: threading.Condition) -> None:
        """Starts ``pe``'s launches of execution ``run_id`` (XLA's ``RunId``; 0: unknown,
        nothing done) after the same epoch as the team's other ranks in that execution: the
        highest epoch any rank had reached when the first of them arrived. A rank that
        skipped an execution's call (its program failed before it) thereby catches up, and
        its peers' flags of that execution, which it never saw, stay below its epochs."""
        if not run_id:
            return
        with lock:
            base = self.run_bases.get(run_id)
            if base is None:
                base = self.run_bases[run_id] = max(self.epochs.values(), default=0)
                while len(self.run_bases) > 64:  # older executions have ended everywhere
                    self.run_bases.popitem(last=False)
            if self.epochs.get(pe, 0) < base:
                self.epochs[pe] = base

    def rank_lock(self, rank: int) -> threading.Lock:
        """The lock a rank holds while it runs (its runs of this team one at a time)."""
        return self.locks.setdefault(rank, threading.Lock())


@dataclasses.dataclass
class CallSite:
    """A traced ``triton_call``.

    Attributes:
      kernel: the ``@triton.jit`` kernel.
      label: kernel name for messages.
      variants: the launches the site may make (keyword arguments, compile options,
        grid): one, or one per config of an autotuned kernel; each team runs the one
        :meth:`variant` names.
      team_axes: the mesh axes whose devices form the kernel's teams.
      params: positional kernel arguments: ``("array", index)`` for an operand,
        ``("scalar", value)``, ``("output", index)``, ``("workspace", index)``.
      inputs: per-rank operand specs; ``symmetric`` marks those staged into the heap.
      outputs: per-rank result specs.
      workspaces: per-rank symmetric workspace specs (the largest any variant needs).
      tuner: the autotuned kernel the variants come from, or None.
      timeline: events each program records (the site is timed: ``jtd.timeline``); 0: not
        timed.
    """

    kernel: Any
    label: str
    variants: tuple[Variant, ...]
    team_axes: TeamAxes
    params: list[tuple[str, Any]]
    inputs: list[ArraySpec]
    symmetric: frozenset[int]
    outputs: list[ArraySpec]
    workspaces: list[ArraySpec]
    tuner: Autotuned | None = None
    timeline: int = 0
    call_id: int = 0  # set by register()
    teams: dict[tuple[int, ...], TeamState] = dataclasses.field(default_factory=dict)
    cond: threading.Condition = dataclasses.field(default_factory=threading.Condition)

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """Every manual mesh axis (operand 0 holds the device's coordinates along them)."""
        return self.team_axes.mesh_axes

    @property
    def num_ranks(self) -> int:
        """Ranks per team."""
        return self.team_axes.num_ranks

    @property
    def programs(self) -> int:
        """Programs per launch (the most of any variant)."""
        return max(v.programs for v in self.variants)

    def variant(self, team: TeamState, rank: int) -> Variant:
        """The variant ``rank`` of ``team`` runs (the first until the team chose)."""
        return self.variants[team.choice.get(rank, 0)]

    def gather(self, team: TeamState, rank: int, tag: str, value: int,
               timeout: float) -> list[int]:
        """All-gather of one int among the team's ranks (a collective call: every rank
        calls it with the same ``tag``, once): in this process through the site's
        condition, across processes through the key-value store.

        Raises:
          ShmemTimeoutError: a rank did not arrive within ``timeout`` seconds.
        """
        if team.name:
            return rendezvous.process_gather(f"{team.name}/{tag}", self.num_ranks, rank, value)
        with self.cond:
            values = team.gathered.setdefault(tag, [None] * self.num_ranks)
            values[rank] = int(value)
            self.cond.notify_all()
            self._wait(lambda: all(v is not None for v in values), timeout, f"rank {rank}",
                       f"its team ({tag})", lambda: [r for r, v in enumerate(values) if v is None])
            return list(values)

    def _wait(self, ready: Callable[[], bool], timeout: float, who: str, what: str,
              missing: Callable[[], list[int]],
              stop: Callable[[], str | None] | None = None) -> None:
        """Waits on the site's condition (held by the caller) until ``ready()``.

        Raises:
          ShmemAbortedError: the joins were abandoned (the interpreter is exiting), or
            ``stop()`` gave a reason.
          ShmemTimeoutError: ``timeout`` seconds passed; names the ranks ``missing()``.
        """
        deadline = time.monotonic() + timeout
        while not ready():
            remaining = deadline - time.monotonic()
            if _abandoned.is_set():
                raise shmem.ShmemAbortedError(f"kernel {self.label}: {who} stopped waiting for "
                                              f"{what}: {_abandoned.reason}")
            reason = stop() if stop is not None else None
            if reason is not None:
                raise shmem.ShmemAbortedError(f"kernel {self.label}: {who} stopped waiting for "
                                              f"{what}: {reason}")
            if remaining <= 0:
                raise shmem.ShmemTimeoutError(
                    f"kernel {self.label}: {who} waited {timeout:.1f} s for {what}; ranks "
                    f"{missing()} never arrived")
            self.cond.wait(min(remaining, 0.05))  # now and then: abandon_joins()

    def choose(self, team: TeamState, rank: int, platform: str, device_kind: str,
               measure: tuning.Measure) -> Variant:
        """The variant ``rank`` runs from now on. An autotuned site's ranks choose together
        (``tuning.select``: a collective call at the site's first run on each rank);
        ``measure(index)`` times variant ``index`` on this rank."""
        if rank not in team.choice:
            index = 0
            if len(self.variants) > 1:
                index = tuning.select(
                    self.tuner, self.variants, self.label, rank,
                    self.tuning_key(device_kind), platform,
                    lambda tag, value: self.gather(team, rank, tag, value,
                                                   shmem.wait_timeout()),
                    measure)
            team.choice[rank] = index
        return self.variants[team.choice[rank]]

    def tuning_key(self, device_kind: str) -> dict[str, Any]:
        """What an autotuned site's choice depends on (its disk-cache key)."""
        keys = self.tuner.key if self.tuner is not None else ()
        with python_ast.LOCK:  # the first cache_key parses the source (python_ast.py)
            source = self.kernel.cache_key
        return {
            "kernel": self.label, "source": source,
            "inputs": [(s.shape, s.dtype.name) for s in self.inputs],
            "outputs": [(s.shape, s.dtype.name) for s in self.outputs],
            "scalars": [v for kind, v in self.params if kind == "scalar"],
            "key": {k: self.variants[0].kwargs.get(k) for k in keys},
            "num_ranks": self.num_ranks, "device": device_kind, "versions": _versions(),
            "configs": [v.config.as_dict() for v in self.variants if v.config is not None],
        }

    # -- symmetric region: [barrier counters, abort word | workspaces | staging x2 |
    #    timeline] --

    @functools.cached_property
    def region_layout(self) -> RegionLayout:
        """Offsets inside the region: barrier area, abort word, workspaces, staging slots,
        timeline area; total size."""
        cursor = aligned(8 * self.num_ranks + 8)
        workspace_offsets = []
        for spec in self.workspaces:
            workspace_offsets.append(cursor)
            cursor += aligned(spec.nbytes)
        staging = {}
        for index in sorted(self.symmetric):
            size = aligned(self.inputs[index].nbytes)
            staging[index] = (cursor, cursor + size)
            cursor += 2 * size
        timeline_offset = 0
        if self.timeline:
            timeline_offset = cursor
            cursor += aligned(timeline.area_bytes(self.programs, self.timeline))
        return RegionLayout(0, 8 * self.num_ranks, workspace_offsets, staging, cursor,
                            timeline_offset)

    def join(self, coords: tuple[int, ...], pe: int, timeout: float,
             allocate: Callable[[CallSite, TeamState], Any],
             instance: int = 0,
             stop: Callable[[], str | None] | None = None) -> tuple[int, TeamState]:
        """Registers ``pe`` in its team; the first run waits for every rank of the team.
        ``instance``: which custom call of the site runs (each has its own teams).
        ``stop()``: polled while waiting; a reason to give up (the execution failed).

        The last rank to arrive calls ``allocate(site, team)`` (with every rank's PE known)
        and stores its result as ``team.region``.

        Returns:
          This PE's rank and the (ready) team state.
        """
        rank, key = self.team_axes.locate(coords)
        if instance:
            key = instance_key(instance, key)
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
            self._wait(lambda: team.ready, timeout, f"rank {rank} (PE {pe})",
                       "the first run of its team (every rank of a team must run the same "
                       "call: a lax.cond whose predicate differs between ranks sends them "
                       "to different calls)",
                       lambda: [r for r, p in enumerate(team.pes) if p is None], stop)
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
        rank, key = self.team_axes.locate(coords)
        with self.cond:
            team = self.teams.get(key)
            if team is None or team.generation != lifetime.generation():
                team_name = f"{name}/team{'-'.join(map(str, key))}"
                pes = gather(f"{team_name}/pes", self.num_ranks, rank, pe)
                team = TeamState(pes=pes, generation=lifetime.generation(), name=team_name)
                team.region = allocate(self, team)
                self.teams[key] = team
        return rank, team


@functools.cache
def _versions() -> dict[str, str]:
    versions = {}
    for package in ("jax", "jaxlib", "triton", "jax_triton_dist"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "unknown"
    return versions


def local_pes(team: TeamState) -> list[int]:
    """The team's PEs whose memory this process initialises (all, in one process)."""
    mine = heap.process_pe()
    return list(team.pes) if mine < 0 else [pe for pe in team.pes if pe == mine]


def allocate_region(site: CallSite, team: TeamState, extra: int = 0) -> int:
    """The team's symmetric region (``site.region_layout`` plus ``extra`` bytes): one
    offset reserved in every PE heap, zeroed on the team's members (those of this
    process). Returns the offset."""
    total = aligned(site.region_layout.total) + extra
    offset = heap.reserve(total, f"kernel {site.label}'s workspaces")
    for pe in local_pes(team):
        heap.memset(pe, heap.heap_base(pe) + offset, 0, total)
    team.offset = offset
    return offset


class _Abandoned(threading.Event):
    """Set when every join must give up (the interpreter is exiting); says why."""

    reason = ""


_abandoned = _Abandoned()


def abandon_joins(reason: str) -> None:
    """Makes every waiting and future :meth:`CallSite.join` raise ShmemAbortedError."""
    _abandoned.reason = reason
    _abandoned.set()


_sites: dict[int, CallSite] = {}
_ids = itertools.count(1)
_lock = threading.Lock()


def register(site: CallSite) -> int:
    """Stores ``site``; returns its id (the custom call's ``call_id`` attribute)."""
    with _lock:
        call_id = next(_ids)
        site.call_id = call_id
        _sites[call_id] = site
    return call_id


def find(call_id: int) -> CallSite | None:
    """The call site of ``call_id``, or None."""
    return _sites.get(call_id)


def lookup(call_id: int) -> CallSite:
    """The call site of ``call_id``."""
    site = find(call_id)
    if site is None:
        raise RuntimeError(f"unknown jax_triton_dist call site {call_id} (released: no "
                           "executable used it any more)")
    return site


_releasers: list[Callable[[int, CallSite], None]] = []


def on_release(hook: Callable[[int, CallSite], None]) -> None:
    """Runs ``hook(call_id, site)`` when a site is released, before its regions are freed
    (a backend drops its launch plans, after its devices finished with the site)."""
    if hook not in _releasers:
        _releasers.append(hook)


def release(call_id: int) -> None:
    """Forgets the site and frees its teams' regions (of the current SHMEM instance).

    Teams that span processes keep their region: releasing is not collective, and every
    process must keep making the same allocations in the same order.
    """
    with _lock:
        site = _sites.pop(call_id, None)
    if site is None:
        return
    for hook in _releasers:
        hook(call_id, site)
    if heap.running_backend() is None:
        return
    for team in site.teams.values():
        _free_region(team)


def _free_region(team: TeamState) -> None:
    """Frees a team's region (of this process, of the current SHMEM instance)."""
    if team.offset is not None and not team.name and team.generation == lifetime.generation():
        heap.release(team.offset)
        team.offset = None


def instance_key(instance: int, key: tuple) -> tuple:
    """The team key of custom call ``instance`` (CPU: a call site's custom calls each have
    their teams)."""
    return ("instance", instance, *key)


def release_instance(call_id: int, instance: int) -> None:
    """Frees the regions of the teams of one custom call of a site whose other custom calls
    live on (an executable that used the site is gone)."""
    site = find(call_id)
    if site is None or heap.running_backend() is None:
        return
    with site.cond:
        keys = [k for k in site.teams if k[:2] == ("instance", instance)]
        teams = [site.teams.pop(k) for k in keys]
    for team in teams:
        _free_region(team)


def live_sites() -> tuple[int, int]:
    """``(call sites, team regions)`` held now."""
    with _lock:
        sites = list(_sites.values())
    regions = sum(1 for site in sites for team in site.teams.values()
                  if team.offset is not None and team.generation == lifetime.generation())
    return len(sites), regions

