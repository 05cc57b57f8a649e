"""Distributed autotuning of kernels launched with ``triton_call``.

Wrap a kernel with :func:`autotune` and pass the result to ``jtd.triton_call`` in place of
the kernel; ``grid`` (and ``workspace``) may then be functions of the keyword arguments,
each config's included, as with ``triton.autotune``::

    @jtd.autotune.autotune(
        configs=[jtd.autotune.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8),
                 jtd.autotune.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4)],
        key=["M", "N", "K"])
    @triton.jit
    def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, ...): ...

    jtd.triton_call(matmul_kernel, a, b, M=m, N=n, K=k, out_shape=...,
                    grid=lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * ...,),
                    axis_name="tp")

**Collective and consistent.** A call site chooses its config at its first run, per team:
every rank times every config (same warm-up and repeat counts, same order) on the call's
own operands, the times are all-gathered through the team and reduced by ``max``, and every
rank takes the fastest — a choice that differs between ranks cannot happen. Configs that
fail to compile or run are skipped on every rank, with the reason logged; with
``check=True`` so are configs whose outputs differ from the first config's. This works on
every process model (threads of one process, one process per GPU through JAX's key-value
store) and in ``jax_triton_dist.one_gpu.run_ranks``.

**Cached.** Choices are stored in a JSON file (:data:`CACHE_ENV`, default
``~/.cache/jax_triton_dist/autotune.json``) keyed by the kernel's source, operand shapes and
dtypes, the ``key`` arguments, rank count, device kind, software versions and the config
space; a later process reuses them without timing anything.

**When.** ``$JTD_AUTOTUNE``: ``gpu`` (default) tunes on GPUs only; ``all`` also in the CPU
interpreter (slow; for testing tuned kernels); ``off`` never tunes. Without tuning the
cached config is used, else the first one — so list the configs with the best default
first. ``autotune(..., enabled=False)`` switches one kernel off. ``JTD_LOG=autotune`` logs
every config timed; tuning that takes more than a few seconds logs its progress anyway.

The project's own GEMM-based ops (``all_gather_matmul``, ``matmul_reduce_scatter``,
``matmul_all_reduce``) tune their tiles this way on GPUs, checked; their first config is
the fixed table of ``jax_triton_dist.tiles``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax_triton_dist.runtime import tuning_cache
from jax_triton_dist.runtime.tuning import (
    AUTOTUNE_ENV,
    MODES,
    Autotuned,
    Config,
    Timer,
    TuningRecord,
)
from jax_triton_dist.runtime.tuning_cache import CACHE_ENV

__all__ = ["autotune", "Config", "Autotuned", "TuningRecord", "AUTOTUNE_ENV", "CACHE_ENV",
           "MODES", "cache_path", "cache_entries"]


def autotune(configs: Sequence[Config] | Callable[[dict[str, Any]], Sequence[Config]],
             key: Sequence[str] | str = (), *,
             prune: Callable[[list[Config], dict[str, Any]], Sequence[Config]] | None = None,
             warmup: int = 2, rep: int = 5, enabled: bool | None = None,
             timer: Timer | None = None, check: bool = False,
             check_tolerance: float = 1e-2) -> Callable[[Any], Autotuned]:
    """Decorator: a ``@triton.jit`` kernel with a config space, for ``triton_call``.

    Args:
      configs: the configs, tried in this order; the first is the default when tuning is
        off. Or a function of the call's keyword arguments returning them (a space that
        depends on the problem's shape), called at trace time.
      key: names of keyword arguments of the call that select a cache entry (besides the
        operand shapes and dtypes, rank count and device kind, always part of it).
      prune: ``prune(configs, kwargs) -> configs``: drops configs that cannot suit a call
        (e.g. tiles larger than the problem), at trace time.
      warmup: untimed launches of each config before timing it.
      rep: timed launches per config; a rank's time is their median.
      enabled: False switches tuning off for this kernel; None follows ``$JTD_AUTOTUNE``.
      timer: ``timer(config, rank, seconds) -> seconds`` replaces each rank's measured
        time (for tests and for custom cost models).
      check: while tuning, compare each config's outputs on every rank with those of the
        first config that ran everywhere; a config whose outputs differ (floating-point
        outputs beyond ``check_tolerance`` relative error, other outputs not equal) is
        skipped on every rank with the reason logged, as a failing one is — so a config
        the compiler gets wrong is never chosen (seen with Triton 3.6: its warp-specialized
        Hopper GEMM with per-thread stores). For kernels whose outputs depend only on
        their inputs; it costs a copy of the outputs per config while tuning.
      check_tolerance: see ``check``.

    Returns:
      A decorator making an :class:`Autotuned` kernel. Its ``records`` list how each rank
      chose (config, source ``tuned``/``cache``/``default``, times).

    Raises:
      ValueError: no configs, or bad warmup / rep.
      TypeError: not a ``@triton.jit`` kernel.
    """
    def wrap(kernel: Any) -> Autotuned:
        return Autotuned(kernel, configs if callable(configs) else tuple(configs), key,
                         prune, warmup, rep, enabled, timer, check, check_tolerance)

    return wrap


def cache_path() -> str | None:
    """The disk cache's file (None: ``$JTD_AUTOTUNE_CACHE`` is empty, no disk cache)."""
    return tuning_cache.path()


def cache_entries() -> dict[str, dict[str, Any]]:
    """The disk cache's entries: key -> chosen config, times and the call's description."""
    return tuning_cache.entries()
