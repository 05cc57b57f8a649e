"""Runs one program with ``jax.lax``'s collectives and with ``jax_triton_dist.lax``'s and
compares the two per device shard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_triton_dist as jtd

XLA_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                   "collective-permute")

# Relative tolerance of a reduction against XLA's (which sums in another order, and
# rounds sub-f32 partial sums where we accumulate in f32).
_RTOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12,
         np.dtype(np.complex64): 1e-5, np.dtype(np.complex128): 1e-12,
         np.dtype(np.float16): 4e-3, np.dtype(ml_dtypes.bfloat16): 2e-2}
_RTOL_FLOAT8 = 0.25


def both(program: Callable[[Any], Any]) -> tuple[Any, Any]:
    """``(program(jax.lax), program(jtd.lax))``, computed; skips the test when
    ``jax.lax`` fails too (those cases are not required to pass)."""
    try:
        reference = jax.block_until_ready(program(jax.lax))
    except Exception as error:  # noqa: BLE001 - reported as the skip reason
        pytest.skip(f"fails with jax.lax too: {type(error).__name__}: {str(error)[:300]}")
    return reference, jax.block_until_ready(program(jtd.lax))


def _shards(value: Any) -> list[tuple[Any, np.ndarray]]:
    shards = getattr(value, "addressable_shards", None)
    if not shards:
        return [(None, np.asarray(value))]
    return [(s.index, np.asarray(s.data)) for s in sorted(shards, key=lambda s: s.device.id)]


def _close(want: np.ndarray, got: np.ndarray, exact: bool, where: str) -> None:
    if exact or not jnp.issubdtype(want.dtype, jnp.inexact):
        assert want.tobytes() == got.tobytes(), (
            f"{where}: not bit-identical\nwant {want}\ngot  {got}")
        return
    rtol = _RTOL.get(want.dtype, _RTOL_FLOAT8)
    work = np.complex128 if jnp.issubdtype(want.dtype, jnp.complexfloating) else np.float64
    want, got = want.astype(work), got.astype(work)
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=where)


def assert_same(reference: Any, ours: Any, *, exact: bool = True, per_shard: bool = True
                ) -> None:
    """Same tree, shapes, dtypes and, on every device, the same values: bit-identical when
    ``exact`` (data movement, integer reductions), else within the reduction tolerance
    of the dtype. ``per_shard=False``: compare whole arrays (results of differently
    sharded programs, e.g. vmap against pmap)."""
    ref_leaves, ref_tree = jax.tree.flatten(reference)
    our_leaves, our_tree = jax.tree.flatten(ours)
    assert ref_tree == our_tree, f"trees differ: {ref_tree} vs {our_tree}"
    for n, (want, got) in enumerate(zip(ref_leaves, our_leaves, strict=True)):
        assert np.shape(want) == np.shape(got), f"leaf {n}: {np.shape(want)} vs {np.shape(got)}"
        assert np.asarray(want).dtype == np.asarray(got).dtype, f"leaf {n}: dtypes differ"
        if per_shard:
            want_shards, got_shards = _shards(want), _shards(got)
        else:
            want_shards, got_shards = [(None, np.asarray(want))], [(None, np.asarray(got))]
        assert len(want_shards) == len(got_shards), f"leaf {n}: shard counts differ"
        for (index, w), (got_index, g) in zip(want_shards, got_shards, strict=True):
            assert index == got_index, f"leaf {n}: shard {index} vs {got_index}"
            _close(w, g, exact, f"leaf {n}, shard {index}")


def assert_kernel_path(compiled_text: str) -> None:
    """The compiled program runs the project's custom call and no XLA collective."""
    assert "jtd_triton" in compiled_text
    present = [op for op in XLA_COLLECTIVES if op in compiled_text]
    assert not present, f"XLA collectives in the program: {present}"
