"""Distributed autotuning: a kernel's config space, and the choice of one config per team
at a call site's first run.

A kernel wrapped by :func:`jax_triton_dist.autotune.autotune` (an :class:`Autotuned`) gives
``triton_call`` several *variants* of one call site: the same operands with each config's
constexprs, warps, stages and grid. The runtime picks one per team where it already plans
the site (the first run on each device, ``cpu_dispatch`` / ``cuda_dispatch``):

1. every rank looks the site's key up in the disk cache (``tuning_cache``) and says
   whether it may tune (``$JTD_AUTOTUNE``, the decorator's ``enabled``);
2. if every rank found the same cached config, that is the choice; if any rank may not
   tune, the choice is the first config;
3. else every rank times every variant in the same order, with the same warm-up and
   repeat counts, on the call's own operands (results are overwritten by the real launch;
   kernels never write their inputs); the times are all-gathered through the team and
   reduced by ``max``, and every rank takes the index of the smallest maximum, so that a
   choice that differs between ranks cannot happen. A variant that fails on any rank is
   skipped everywhere, with the reason logged. With ``check``, a variant whose outputs
   differ from the reference's (the first variant that ran on every rank) counts as
   failed: a miscompiled config is never chosen.

Each rank's launches advance its epoch as real calls do, so the site's later calls go on
from there.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jax_triton_dist import dtypes
from jax_triton_dist.runtime import debug_settings, launch_log, tuning_cache

__all__ = ["AUTOTUNE_ENV", "MODES", "Config", "Autotuned", "Variant", "TuningRecord", "Trial",
           "select_for_team", "mode",
           "check_environment", "variants_of", "select"]

AUTOTUNE_ENV = "JTD_AUTOTUNE"
"""``off``: never tune (the cached config, else the first); ``gpu`` (default): tune on
GPUs; ``all``: also in the CPU interpreter (slow: for tests of tuned kernels)."""
MODES = ("off", "gpu", "all")
DEFAULT_MODE = "gpu"
PROGRESS_AFTER_S = 2.0
"""Tuning that runs longer than this logs its progress even without ``JTD_LOG=autotune``."""


def mode() -> str:
    """``$JTD_AUTOTUNE`` (default ``gpu``).

    Raises:
      ValueError: not one of :data:`MODES`.
    """
    raw = os.environ.get(AUTOTUNE_ENV, "").strip().lower() or DEFAULT_MODE
    if raw not in MODES:
        raise ValueError(f"{AUTOTUNE_ENV}={os.environ[AUTOTUNE_ENV]!r}: expected one of "
                         f"{', '.join(MODES)}")
    return raw


def check_environment() -> None:
    """Reads the tuning settings, so that a bad one raises where the caller sees it."""
    mode()
    tuning_cache.path()


@dataclasses.dataclass(frozen=True)
class Config:
    """One point of a config space: constexprs (and other keyword arguments) of the
    kernel, and optionally ``num_warps`` / ``num_stages`` (GPU compile options).

    Args:
      kwargs: keyword arguments the config sets (they override ``triton_call``'s).
      num_warps: warps per program on GPUs (None: ``triton_call``'s, else 4).
      num_stages: software-pipelining depth on GPUs (None: ``triton_call``'s, else 3).
      co_resident: the config's programs wait on each other (a persistent kernel), as
        ``triton_call``'s ``co_resident``.
    """

    kwargs: Mapping[str, Any]
    num_warps: int | None = None
    num_stages: int | None = None
    co_resident: bool = False

    def __post_init__(self):
        if not isinstance(self.kwargs, Mapping):
            raise TypeError(f"Config: kwargs must be a mapping of keyword arguments, got "
                            f"{type(self.kwargs).__name__}")
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"Config: {name} must be a positive int, got {value!r}")

    @classmethod
    def from_table(cls, entry: Mapping[str, Any], co_resident: bool | None = None) -> Config:
        """A config from a ``tiles`` entry (constexprs plus ``num_warps`` and, when given,
        ``num_stages``, which become the compile options). ``co_resident`` defaults to the
        entry's ``PERSISTENT`` (a persistent kernel's programs wait on each other)."""
        kwargs = dict(entry)
        warps, stages = kwargs.pop("num_warps", None), kwargs.pop("num_stages", None)
        if co_resident is None:
            co_resident = bool(kwargs.get("PERSISTENT", False))
        return cls(kwargs, num_warps=warps, num_stages=stages, co_resident=co_resident)

    def as_dict(self) -> dict[str, Any]:
        """The config as JSON-compatible data (how the disk cache stores it)."""
        return {"kwargs": dict(sorted(self.kwargs.items())), "num_warps": self.num_warps,
                "num_stages": self.num_stages, "co_resident": self.co_resident}

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.kwargs.items())]
        parts += [f"{name}={getattr(self, name)}" for name in ("num_warps", "num_stages")
                  if getattr(self, name) is not None]
        return ", ".join(parts + (["co_resident"] if self.co_resident else []))


Timer = Callable[[Config, int, float], float]
"""``timer(config, rank, seconds) -> seconds``: replaces a rank's measured time."""


@dataclasses.dataclass(frozen=True)
class TuningRecord:
    """How one rank of one team chose its config at one call site.

    Attributes:
      label: the kernel.
      rank: the rank in its team.
      index: the chosen config's position in the (pruned) candidates.
      config: the chosen config.
      source: ``"tuned"`` (measured now), ``"cache"`` or ``"default"`` (the first config).
      times: per candidate, the slowest rank's seconds (None: it failed somewhere), when
        tuned; else empty.
    """

    label: str
    rank: int
    index: int
    config: Config
    source: str
    times: tuple[float | None, ...] = ()


@dataclasses.dataclass(eq=False)
class Autotuned:
    """A ``@triton.jit`` kernel with a config space; pass it to ``triton_call`` in place of
    the kernel. Made by :func:`jax_triton_dist.autotune.autotune`.

    Attributes:
      kernel: the kernel.
      configs: the config space, in the order every rank tries it; or a function of the
        call's keyword arguments returning it (a space that depends on the shapes).
      key: names of keyword arguments whose values (besides operand shapes and dtypes,
        rank count and device kind) select a cache entry.
      prune: ``prune(configs, kwargs) -> configs`` run at trace time, or None.
      warmup: untimed launches of each config before timing it.
      rep: timed launches of each config (their median is its time on a rank).
      enabled: False: never tune (the cached config, else the first); None: follow
        ``$JTD_AUTOTUNE``.
      timer: replaces measured times (tests; ``timer(config, rank, seconds)``).
      check: compare every config's outputs with the reference config's on each rank
        (:func:`outputs_differ`, ``check_tolerance``); a config that differs anywhere is
        skipped everywhere, with the reason logged.
      check_tolerance: the relative error (Frobenius norm) a floating-point output may
        have against the reference's; integer outputs must be equal.
      records: how each rank chose, newest last.
    """

    kernel: Any
    configs: tuple[Config, ...] | Callable[[dict[str, Any]], Sequence[Config]]
    key: tuple[str, ...] = ()
    prune: Callable[[list[Config], dict[str, Any]], Sequence[Config]] | None = None
    warmup: int = 2
    rep: int = 5
    enabled: bool | None = None
    timer: Timer | None = None
    check: bool = False
    check_tolerance: float = 1e-2
    records: list[TuningRecord] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        fn = getattr(self.kernel, "fn", None)
        if fn is None or not callable(fn):
            raise TypeError(f"autotune: expected a @triton.jit kernel, got "
                            f"{type(self.kernel).__name__}")
        if not callable(self.configs):
            self.configs = self._checked(self.configs)
        self.key = (self.key,) if isinstance(self.key, str) else tuple(self.key)
        if self.warmup < 0 or self.rep < 1:
            raise ValueError(f"autotune({fn.__name__}): need warmup >= 0 and rep >= 1, got "
                             f"warmup={self.warmup}, rep={self.rep}")
        if not self.check_tolerance > 0:
            raise ValueError(f"autotune({fn.__name__}): check_tolerance must be positive, "
                             f"got {self.check_tolerance!r}")

    @property
    def fn(self) -> Callable:
        """The kernel's Python function (``triton_call`` names and checks it)."""
        return self.kernel.fn

    def _checked(self, configs: Sequence[Config]) -> tuple[Config, ...]:
        configs = tuple(configs)
        if not configs or any(not isinstance(c, Config) for c in configs):
            raise ValueError(f"autotune({self.fn.__name__}): configs must be a non-empty "
                             "sequence of jax_triton_dist.autotune.Config")
        return configs

    def candidates(self, kwargs: dict[str, Any]) -> list[Config]:
        """The configs left after ``prune`` for a call with ``kwargs``.

        Raises:
          ValueError: a key name that is not a keyword argument, or nothing left.
        """
        missing = [k for k in self.key if k not in kwargs]
        if missing:
            raise ValueError(f"autotune({self.fn.__name__}): key names {missing} are not "
                             f"keyword arguments of the call (given: {sorted(kwargs)})")
        configs = list(self._checked(self.configs(dict(kwargs))) if callable(self.configs)
                       else self.configs)
        if self.prune is not None:
            configs = list(self.prune(configs, dict(kwargs)))
            if not configs:
                raise ValueError(f"autotune({self.fn.__name__}): prune left no config for "
                                 f"{ {k: kwargs[k] for k in self.key} }")
        return configs

    def may_tune(self, platform: str) -> bool:
        """Whether this process may time configs on ``platform`` (``cpu`` or ``gpu``)."""
        if self.enabled is False:
            return False
        setting = mode()
        return setting == "all" or (setting == "gpu" and platform == "gpu")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One launch of a call site: keyword arguments, compile options and grid.

    ``config`` is the autotune config it comes from (None at an untuned site);
    ``co_resident``: the programs wait on each other, so all must run at once."""

    kwargs: dict[str, Any]
    options: dict[str, int]
    grid: tuple[int, ...]
    config: Config | None = None
    co_resident: bool = False

    @property
    def programs(self) -> int:
        """Programs per launch."""
        return math.prod(self.grid)


def variants_of(configs: Sequence[Config] | None, kwargs: dict[str, Any],
                options: dict[str, int], grid: Callable[[dict[str, Any]], tuple[int, ...]],
                co_resident: bool = False) -> tuple[Variant, ...]:
    """The variants of a call: one per config (its keyword arguments over ``kwargs``, its
    warps and stages over ``options``, the grid of the merged arguments), or the call
    itself when ``configs`` is None."""
    if configs is None:
        return (Variant(dict(kwargs), dict(options), grid(kwargs), None, co_resident),)
    out = []
    for config in configs:
        merged = {**kwargs, **config.kwargs}
        opts = dict(options)
        opts.update({k: v for k, v in (("num_warps", config.num_warps),
                                       ("num_stages", config.num_stages)) if v is not None})
        out.append(Variant(merged, opts, grid(merged), config,
                           co_resident or config.co_resident))
    return tuple(out)


# ---------------------------------------------------------------------------
# The collective choice
# ---------------------------------------------------------------------------

Gather = Callable[[str, int], list[int]]
"""``gather(tag, value)``: every team rank's value, in rank order (a collective call)."""
class Trial:
    """One rank's timing of one variant: made (compiled, loaded) before the team starts
    it, :meth:`run` once every rank has its own made, :meth:`close` once every rank has
    run (on one GPU, loading or unloading a module can wait for kernels still running)."""

    def run(self) -> float:
        """Seconds per launch on this rank (raises if the variant cannot run)."""
        raise NotImplementedError

    def outputs(self) -> list[np.ndarray]:
        """This rank's outputs after :meth:`run` (for ``check``)."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases what the trial made."""


Measure = Callable[[int], Trial]
"""``measure(index)``: this rank's :class:`Trial` of variant ``index`` (raises if the
variant cannot be made)."""


def outputs_differ(got: Sequence[np.ndarray], reference: Sequence[np.ndarray],
                   tolerance: float) -> str | None:
    """Why ``got`` (one rank's outputs of a config) is not ``reference`` (the reference
    config's), or None: floating-point outputs within ``tolerance`` relative error
    (Frobenius norm) and with their non-finite values where the reference has them,
    other outputs equal."""
    for i, (out, ref) in enumerate(zip(got, reference, strict=True)):
        out, ref = np.asarray(out), np.asarray(ref)
        if out.shape != ref.shape:
            return f"output {i} has shape {out.shape}, the reference's {ref.shape}"
        if ref.dtype not in dtypes.FLOAT_DTYPES:
            if not np.array_equal(out, ref):
                return f"output {i} differs from the reference config's"
            continue
        out64, ref64 = out.astype(np.float64), ref.astype(np.float64)
        finite = np.isfinite(ref64)
        if not np.array_equal(np.isfinite(out64), finite):
            return f"output {i} has non-finite values where the reference config's has not"
        if not np.array_equal(out64[~finite], ref64[~finite], equal_nan=True):
            return f"output {i}'s non-finite values differ from the reference config's"
        scale = float(np.linalg.norm(ref64[finite])) or 1.0
        error = float(np.linalg.norm(out64[finite] - ref64[finite])) / scale
        if error > tolerance:
            return (f"output {i} differs from the reference config's: relative error "
                    f"{error:.3g} > {tolerance:g}")
    return None


def select(tuner: Autotuned, variants: Sequence[Variant], label: str, rank: int,
           cache_key: dict[str, Any], platform: str, gather: Gather,
           measure: Measure) -> int:
    """Index of the variant the team runs; the same on every rank of the team.

    Every rank of the team calls it at the site's first run, with its own ``measure``;
    ``gather`` is the team's all-gather. ``cache_key`` describes the call (kernel, shapes,
    dtypes, ranks, device kind, software versions, config space).
    """
    key = tuning_cache.key_of(cache_key)
    cached_index = _cached(key, variants)
    wants = tuner.may_tune(platform)
    votes = gather("tune/plan", (cached_index + 1) * 2 + int(wants))
    indices = {v // 2 - 1 for v in votes}
    if len(indices) == 1 and cached_index >= 0:
        return _record(tuner, label, [rank], cached_index, variants, "cache")
    if not all(v % 2 for v in votes):
        return _record(tuner, label, [rank], 0, variants, "default")
    times = _time_variants(tuner, variants, label, rank, gather, measure)
    return _choose(tuner, variants, label, [rank], key, cache_key, times)


def select_for_team(tuner: Autotuned, variants: Sequence[Variant], label: str,
                    ranks: int, cache_key: dict[str, Any], platform: str,
                    measure_team: Callable[[int], list[float | None]],
                    read_team: Callable[[], list[list[np.ndarray]]] | None = None) -> int:
    """:func:`select` for a team that one thread drives (``one_gpu``):
    ``measure_team(index)`` times variant ``index`` on every rank at once and returns each
    rank's seconds (None: it failed there); ``read_team()`` returns every rank's outputs
    as the last measured variant left them (needed for ``check``)."""
    key = tuning_cache.key_of(cache_key)
    cached_index = _cached(key, variants)
    if cached_index >= 0:
        return _record(tuner, label, range(ranks), cached_index, variants, "cache")
    if not tuner.may_tune(platform):
        return _record(tuner, label, range(ranks), 0, variants, "default")
    if tuner.check and read_team is None:
        raise ValueError(f"autotune({label}): check=True needs the team's outputs "
                         "(select_for_team's read_team)")
    times = []
    reference = None
    for index, variant in enumerate(variants):
        per_rank = measure_team(index)
        if tuner.timer is not None:
            per_rank = [None if t is None else float(tuner.timer(variant.config, r, t))
                        for r, t in enumerate(per_rank)]
        ran = all(t is not None for t in per_rank)
        if ran and tuner.check:
            outputs = read_team()
            if reference is None:
                reference = outputs
            else:
                for rank, (got, ref) in enumerate(zip(outputs, reference, strict=True)):
                    why = outputs_differ(got, ref, tuner.check_tolerance)
                    if why:
                        _log(f"jtd autotune kernel={label} rank={rank} config={index + 1}/"
                             f"{len(variants)} failed ({variant.config}): {why}", True)
                        ran = False
        times.append(max(per_rank) if ran else None)
        _progress(times, variant, index, len(variants), label, 0.0)
    return _choose(tuner, variants, label, range(ranks), key, cache_key, times)


def _cached(key: str, variants: Sequence[Variant]) -> int:
    """Index of the variant stored under ``key``, or -1."""
    configs = [v.config.as_dict() for v in variants]
    cached = tuning_cache.lookup(key)
    return configs.index(cached) if cached in configs else -1


def _choose(tuner: Autotuned, variants: Sequence[Variant], label: str, ranks: Sequence[int],
            key: str, cache_key: dict[str, Any], times: list[float | None]) -> int:
    """The fastest variant by its slowest rank's time, stored in the cache."""
    usable = [(t, i) for i, t in enumerate(times) if t is not None]
    if not usable:
        raise RuntimeError(f"autotune({label}): no config ran on every rank of the team "
                           f"({len(variants)} tried; the reasons are logged)")
    best = min(usable)[1]
    tuning_cache.store(key, variants[best].config.as_dict(), {
        "kernel": label, "times_us": [None if t is None else round(t * 1e6, 3) for t in times],
        "call": cache_key})
    return _record(tuner, label, ranks, best, variants, "tuned", tuple(times))


def _time_variants(tuner: Autotuned, variants: Sequence[Variant], label: str, rank: int,
                   gather: Gather, measure: Measure) -> list[float | None]:
    """Every variant's slowest-rank time (None: it failed on some rank)."""
    start = time.monotonic()
    times: list[float | None] = []
    reference = None  # check: this rank's outputs of the first variant that ran everywhere
    for index, variant in enumerate(variants):
        trial, mine, outputs = None, -1, None
        try:
            trial = measure(index)
            gather(f"tune/{index}/start", 0)  # every rank made its trial: start together
            seconds = trial.run()
            if tuner.timer is not None:
                seconds = float(tuner.timer(variant.config, rank, seconds))
            if tuner.check:
                outputs = trial.outputs()
                why = reference is not None and outputs_differ(outputs, reference,
                                                               tuner.check_tolerance)
                if why:
                    raise ValueError(why)
            mine = max(1, round(seconds * 1e9))
        except Exception as error:  # a config that does not compile or run here
            if trial is None:
                gather(f"tune/{index}/start", 0)
            _log(f"jtd autotune kernel={label} rank={rank} config={index + 1}/{len(variants)} "
                 f"failed ({variant.config}): {type(error).__name__}: {error}", True)
        everyone = gather(f"tune/{index}", mine)
        if trial is not None:
            trial.close()
        times.append(None if min(everyone) < 0 else max(everyone) / 1e9)
        if tuner.check and reference is None and times[-1] is not None:
            reference = outputs
        if rank == 0:
            _progress(times, variant, index, len(variants), label, start)
    return times


def _progress(times: list[float | None], variant: Variant, index: int, count: int,
              label: str, start: float) -> None:
    done = [t for t in times if t is not None]
    shown = "failed" if times[-1] is None else f"{times[-1] * 1e6:.1f}"
    best = f"{min(done) * 1e6:.1f}" if done else "-"
    _log(f"jtd autotune kernel={label} config={index + 1}/{count} time_us={shown} "
         f"best_us={best} ({variant.config})", time.monotonic() - start > PROGRESS_AFTER_S)


def _log(message: str, always: bool) -> None:
    if always or debug_settings.logs("autotune"):
        launch_log.emit(message)


def _record(tuner: Autotuned, label: str, ranks: Sequence[int], index: int,
            variants: Sequence[Variant], source: str,
            times: tuple[float | None, ...] = ()) -> int:
    for rank in ranks:
        tuner.records.append(TuningRecord(label, rank, index, variants[index].config, source,
                                          times))
    if 0 in ranks:
        _log(f"jtd autotune kernel={label} source={source} config={index + 1}/{len(variants)} "
             f"({variants[index].config})", False)
    return index
