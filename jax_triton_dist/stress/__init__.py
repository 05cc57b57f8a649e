"""``python -m jax_triton_dist.stress``: precision and hang verification of the public ops.

Each iteration draws, for an op, a rank count, a dtype and shapes that respect the op's
divisibility rules, runs the op under ``jax.jit(jax.shard_map(...))`` and compares every
rank's result with the same computation in ``jax.lax`` / ``jnp`` in float32, with
dtype-aware tolerances (:func:`tolerance`). A case is reproduced by its seed and
iteration (``--seed S --only I``). Ops are :class:`StressOp` objects in a registry; a module
named with ``--module`` may register more (a user's own ops, or a planted bug).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Case", "StressOp", "register", "registry", "tolerance"]


@dataclasses.dataclass
class Case:
    """One drawn case: a shard_map body, its float32 reference, global inputs and specs."""

    description: str  # shapes and options, for the report
    body: Callable
    reference: Callable  # the same on float32 inputs, in jax.lax / jnp
    inputs: list[Any]  # global NumPy arrays (in the case's dtype)
    in_specs: Any
    out_specs: Any
    kind: str = "movement"  # "movement" (bit-exact), "reduction", "gemm": the tolerance


@dataclasses.dataclass(frozen=True)
class StressOp:
    """A public op under test.

    Attributes:
      name: the command-line name.
      dtypes: dtypes drawn by default.
      draw: ``draw(rng, ranks, dtype, scale) -> Case``: one random case on a one-axis mesh
        named ``"x"`` of ``ranks`` devices; ``scale`` (1 on CPU, larger on GPUs) scales
        the shapes.
      min_ranks: the smallest rank count the op takes.
    """

    name: str
    dtypes: tuple[str, ...]
    draw: Callable[[np.random.Generator, int, str, int], Case]
    min_ranks: int = 1


_registry: dict[str, StressOp] = {}


def register(op: StressOp) -> StressOp:
    """Adds ``op`` to the registry (a later op of the same name replaces it)."""
    _registry[op.name] = op
    return op


def registry() -> dict[str, StressOp]:
    """The registered ops, built-in ones first."""
    from jax_triton_dist.stress import ops  # noqa: F401 - registers the built-in ops

    return dict(_registry)


def tolerance(dtype: str, kind: str) -> tuple[float, float]:
    """``(rtol, scale_atol)``: an element passes when ``|got - want| <= rtol * |want| +
    scale_atol * max|want|`` (the second term allows for cancellation in sums).

    Data movement is bit-exact. Reductions round once from a float32 (float64 for float64)
    accumulator; GEMMs accumulate in float32, and float32 GEMMs may use TF32 on GPUs.
    """
    if kind == "movement" or np.issubdtype(np.dtype(dtype), np.integer) or dtype == "bool":
        return 0.0, 0.0
    eps = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24,
           "float64": 2.0 ** -53}.get(dtype, 2.0 ** -8)
    if kind == "gemm":
        eps = max(eps, 2.0 ** -11)  # TF32 products of float32 operands
        return 4 * eps, 4 * eps
    return 2 * eps, 16 * max(eps, 2.0 ** -24)
