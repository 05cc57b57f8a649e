"""The built-in stress cases: every public collective, fused op, MoE dispatch/combine and
attention op.

Each ``draw`` returns a case on a one-axis mesh ``"x"``; its reference is the same
computation with ``jax.lax`` collectives and ``jnp`` on float32 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist.stress import Case, StressOp, register

F32 = jnp.float32
COLLECTIVE_DTYPES = ("float32", "bfloat16", "float16", "int32")
GEMM_DTYPES = ("bfloat16", "float16", "float32")


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Values exactly representable in ``dtype``: normal floats (rounded to the dtype),
    integers in [-1000, 1000), booleans."""
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-1000, 1000, shape).astype(dtype)
    return np.asarray(jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype))


def _f32(x):
    return x.astype(F32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _rows(rng, scale):
    return int(rng.choice([1, 2, 3, 4, 8, 16])) * scale


def _cols(rng, scale):
    return int(rng.choice([1, 5, 16, 33, 64])) * scale


def _all_gather(rng, n, dtype, scale):
    m, h = _rows(rng, scale), _cols(rng, scale)
    tiled = bool(rng.integers(2))
    axis = int(rng.integers(2))

    def body(x):
        return jtd.all_gather(x, "x", axis=axis, tiled=tiled)

    def reference(x):
        return jax.lax.all_gather(_f32(x), "x", axis=axis, tiled=tiled)

    return Case(f"[{m},{h}] axis={axis} tiled={tiled}", body, reference,
                [random_array(rng, (n * m, h), dtype)], P("x"), P("x"), "movement")


def _reduce_scatter(rng, n, dtype, scale):
    m, h = _rows(rng, scale), _cols(rng, scale)

    def body(x):
        return jtd.reduce_scatter(x, "x", scatter_dimension=0, tiled=True)

    def reference(x):
        return jax.lax.psum_scatter(_f32(x), "x", scatter_dimension=0, tiled=True)

    return Case(f"[{n * m},{h}] sum", body, reference,
                [random_array(rng, (n * n * m, h), dtype)], P("x"), P("x"), "reduction")


def _all_reduce(rng, n, dtype, scale):
    m, h = _rows(rng, scale), _cols(rng, scale)
    op = str(rng.choice(["sum", "max", "min"]))
    lax_op = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[op]

    def body(x):
        return jtd.all_reduce(x, "x", op=op)

    def reference(x):
        return lax_op(_f32(x), "x")

    return Case(f"[{m},{h}] op={op}", body, reference, [random_array(rng, (n * m, h), dtype)],
                P("x"), P(), "movement" if op != "sum" else "reduction")


def _all_to_all(rng, n, dtype, scale):
    m, h = _rows(rng, scale), _cols(rng, scale)

    def body(x):
        return jtd.all_to_all(x, "x", 0, 0, tiled=True)

    def reference(x):
        return jax.lax.all_to_all(_f32(x), "x", 0, 0, tiled=True)

    return Case(f"[{n * m},{h}]", body, reference, [random_array(rng, (n * n * m, h), dtype)],
                P("x"), P("x"), "movement")


def _gemm_dims(rng, scale):
    return (int(rng.choice([1, 4, 16, 32])) * scale, int(rng.choice([16, 32, 48])) * scale,
            int(rng.choice([16, 32, 64])) * scale)


def _all_gather_matmul(rng, n, dtype, scale):
    m, k, cols = _gemm_dims(rng, scale)

    def body(x, w):
        return jtd.all_gather_matmul(x, w, "x")

    def reference(x, w):
        return jax.lax.all_gather(_f32(x), "x", tiled=True) @ _f32(w)

    return Case(f"x[{m},{k}] w[{k},{cols}]", body, reference,
                [random_array(rng, (n * m, k), dtype), random_array(rng, (k, n * cols), dtype)],
                (P("x"), P(None, "x")), P(None, "x"), "gemm")


def _matmul_reduce_scatter(rng, n, dtype, scale):
    m, k, cols = _gemm_dims(rng, scale)

    def body(x, w):
        return jtd.matmul_reduce_scatter(x, w, "x")

    def reference(x, w):
        return jax.lax.psum_scatter(_f32(x) @ _f32(w), "x", tiled=True)

    return Case(f"x[{n * m},{k}] w[{k},{cols}]", body, reference,
                [random_array(rng, (n * m, n * k), dtype), random_array(rng, (n * k, cols), dtype)],
                (P(None, "x"), P("x")), P("x"), "gemm")


def _matmul_all_reduce(rng, n, dtype, scale):
    m, k, cols = _gemm_dims(rng, scale)

    def body(x, w):
        return jtd.matmul_all_reduce(x, w, "x")

    def reference(x, w):
        return jax.lax.psum(_f32(x) @ _f32(w), "x")

    return Case(f"x[{m},{k}] w[{k},{cols}]", body, reference,
                [random_array(rng, (m, n * k), dtype), random_array(rng, (n * k, cols), dtype)],
                (P(None, "x"), P("x")), P(), "gemm")


def _moe(rng, n, dtype, scale):
    local_experts = int(rng.choice([1, 2]))
    experts = n * local_experts
    t, h, k = _rows(rng, scale), int(rng.choice([8, 16, 32])) * scale, int(rng.choice([1, 2]))

    def body(tokens, ids, weights):
        inputs, routing = jtd.moe_dispatch(tokens, ids, "x", num_experts=experts)
        first = jax.lax.axis_index("x") * local_experts
        factor = (first + jnp.arange(local_experts) + 1).astype(inputs.dtype)
        return jtd.moe_combine(inputs * factor[:, None, None], routing, weights, "x")

    def reference(tokens, ids, weights):
        factor = jnp.sum(_f32(weights) * (ids + 1).astype(F32), axis=1)
        return _f32(tokens) * factor[:, None]

    ids = rng.integers(0, experts, (n * t, k)).astype(np.int32)
    return Case(f"T={t} H={h} top{k} E={experts}", body, reference,
                [random_array(rng, (n * t, h), dtype), ids,
                 random_array(rng, (n * t, k), dtype)],
                (P("x"), P("x"), P("x")), P("x"), "gemm")


def _attention_reference(q, k, v, causal):
    """Per rank: this rank's queries over the gathered keys, masked by global position."""
    s, group = q.shape[1], q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(jax.lax.all_gather(_f32(x), "x", axis=1, tiled=True), group, axis=2)
            for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", _f32(q), k) / np.sqrt(q.shape[-1])
    if causal:
        rows = jax.lax.axis_index("x") * s + jnp.arange(s)
        scores = jnp.where(jnp.arange(k.shape[1])[None, :] <= rows[:, None], scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _sequence_parallel_attention(rng, n, dtype, scale):
    b, s = int(rng.choice([1, 2])), int(rng.choice([2, 4, 8])) * scale
    kvh = int(rng.choice([1, 2]))
    h, d = kvh * int(rng.choice([1, 2])), int(rng.choice([16, 32]))
    causal = bool(rng.integers(2))

    def body(q, k, v):
        return jtd.sequence_parallel_attention(q, k, v, "x", causal=causal)

    def reference(q, k, v):
        return _attention_reference(q, k, v, causal)

    spec = P(None, "x")
    return Case(f"[{b},{s},{h},{d}] kv_heads={kvh} causal={causal}", body, reference,
                [random_array(rng, (b, n * s, h, d), dtype),
                 random_array(rng, (b, n * s, kvh, d), dtype),
                 random_array(rng, (b, n * s, kvh, d), dtype)], (spec,) * 3, spec, "gemm")


def _flash_decode(rng, n, dtype, scale):
    b, s, kvh = int(rng.choice([1, 3])), int(rng.choice([4, 8])) * scale, int(rng.choice([1, 2]))
    h, d = kvh * int(rng.choice([1, 4])), 16
    lengths = rng.integers(1, n * s + 1, b).astype(np.int32)

    def body(q, k, v):
        return jtd.flash_decode(q, k, v, "x", kv_lengths=jnp.asarray(lengths))[None]

    def reference(q, k, v):
        """Per rank: attention over the gathered cache, up to each row's length."""
        group = h // kvh
        kk, vv = (jnp.repeat(jax.lax.all_gather(_f32(x), "x", axis=1, tiled=True), group,
                             axis=2) for x in (k, v))
        scores = jnp.einsum("bhd,bshd->bhs", _f32(q), kk) / np.sqrt(d)
        valid = jnp.arange(n * s)[None, None, :] < jnp.asarray(lengths)[:, None, None]
        probs = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
        return jnp.einsum("bhs,bshd->bhd", probs, vv)[None]

    return Case(f"[{b},{h},{d}] cache {n * s} kv_heads={kvh}", body, reference,
                [random_array(rng, (b, h, d), dtype),
                 random_array(rng, (b, n * s, kvh, d), dtype),
                 random_array(rng, (b, n * s, kvh, d), dtype)],
                (P(), P(None, "x"), P(None, "x")), P("x"), "gemm")


BUILT_IN = (
    StressOp("all_gather", COLLECTIVE_DTYPES + ("bool", "uint8", "float8_e4m3fn"), _all_gather),
    StressOp("reduce_scatter", COLLECTIVE_DTYPES, _reduce_scatter),
    StressOp("all_reduce", COLLECTIVE_DTYPES, _all_reduce),
    StressOp("all_to_all", COLLECTIVE_DTYPES + ("bool", "int8"), _all_to_all),
    StressOp("all_gather_matmul", GEMM_DTYPES, _all_gather_matmul),
    StressOp("matmul_reduce_scatter", GEMM_DTYPES, _matmul_reduce_scatter),
    StressOp("matmul_all_reduce", GEMM_DTYPES, _matmul_all_reduce),
    StressOp("moe", ("float32", "bfloat16"), _moe),
    StressOp("sequence_parallel_attention", ("float32", "bfloat16"),
             _sequence_parallel_attention),
    StressOp("flash_decode", ("float32", "bfloat16"), _flash_decode),
)
for _op in BUILT_IN:
    register(_op)
