"""Attention benchmark at world size 1: ``jtd.sequence_parallel_attention`` and
``jtd.flash_decode`` against ``jax.nn.dot_product_attention`` (XLA's implementation and,
where JAX has it on the device, cuDNN's), forward and backward, kernel-alone device times
(``device_time``) on the same bf16 operands.

FLOPs counted as the standard dense count: forward ``4 * batch * heads * seq_q * seq_k *
head_dim`` (halved when causal), backward 2.5 times the forward.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist.bench import device_time

SEQS = [4096, 16384, 32768]
HEADS, HEAD_DIM = 32, 128


def _ours(mesh, causal: bool):
    spec = P(None, "x")
    return jax.shard_map(
        lambda q, k, v: jtd.sequence_parallel_attention(q, k, v, "x", causal=causal),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)


def _lax(implementation: str, causal: bool):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation=implementation)


def _forward_backward(fn):
    """Jitted forward, and jitted backward (gradients of sum(out * dout))."""
    forward = jax.jit(fn)

    def loss(q, k, v, dout):
        return jnp.sum((fn(q, k, v) * dout).astype(jnp.float32))

    backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return forward, backward


def _time(fn, args, iters: int) -> float | None:
    """Median kernel seconds, or None when the implementation cannot run here (cuDNN
    missing, out of memory)."""
    try:
        return device_time.kernel_seconds(fn, *args, calls=iters).seconds
    except Exception as error:  # noqa: BLE001 - reported in the row
        print(f"    {type(error).__name__}: {str(error)[:200]}")
        return None


def prefill(seqs: list[int], iters: int, causal: bool, platform: str | None,
            dtype=jnp.bfloat16) -> list[dict[str, Any]]:
    """Sequence-parallel attention (one rank) vs XLA and cuDNN, forward and backward."""
    device = jax.devices(platform)[0]
    mesh = Mesh(np.array([device]), ("x",))
    rows = []
    for seq in seqs:
        rng = np.random.default_rng(seq)
        shape = (1, seq, HEADS, HEAD_DIM)
        q, k, v, dout = (jax.device_put(jnp.asarray(rng.standard_normal(shape), dtype), device)
                         for _ in range(4))
        flops = 4.0 * HEADS * seq * seq * HEAD_DIM * (0.5 if causal else 1.0)
        row = {"bench": "prefill", "seq": seq, "heads": HEADS, "head_dim": HEAD_DIM,
               "causal": causal, "dtype": jnp.dtype(dtype).name}
        impls = {"ours": _ours(mesh, causal), "xla": _lax("xla", causal)}
        if device.platform == "gpu":
            impls["cudnn"] = _lax("cudnn", causal)
        for name, fn in impls.items():
            forward, backward = _forward_backward(fn)
            fwd = _time(forward, (q, k, v), iters)
            bwd = _time(backward, (q, k, v, dout), iters)
            row[f"{name}_fwd_us"] = None if fwd is None else fwd * 1e6
            row[f"{name}_bwd_us"] = None if bwd is None else bwd * 1e6
            row[f"{name}_fwd_tflops"] = None if fwd is None else flops / fwd / 1e12
            row[f"{name}_bwd_tflops"] = None if bwd is None else 2.5 * flops / bwd / 1e12
        for other in ("xla", "cudnn"):
            if row.get(f"{other}_fwd_us") and row["ours_fwd_us"]:
                row[f"fwd_vs_{other}"] = row[f"{other}_fwd_us"] / row["ours_fwd_us"]
            if row.get(f"{other}_bwd_us") and row["ours_bwd_us"]:
                row[f"bwd_vs_{other}"] = row[f"{other}_bwd_us"] / row["ours_bwd_us"]
        rows.append(row)
    return rows


def decode(seqs: list[int], iters: int, platform: str | None, batch: int = 8,
           kv_heads: int | None = None, dtype=jnp.bfloat16) -> list[dict[str, Any]]:
    """Flash-decode (one rank) vs ``dot_product_attention`` of one query per row
    (grouped-query: ``kv_heads``, default a quarter of the heads)."""
    kv_heads = kv_heads or max(1, HEADS // 4)
    device = jax.devices(platform)[0]
    mesh = Mesh(np.array([device]), ("x",))
    rows = []
    for seq in seqs:
        rng = np.random.default_rng(seq)
        q = jax.device_put(jnp.asarray(rng.standard_normal((batch, HEADS, HEAD_DIM)), dtype),
                           device)
        cache = [jax.device_put(jnp.asarray(
            rng.standard_normal((batch, seq, kv_heads, HEAD_DIM)), dtype), device)
            for _ in range(2)]
        ours = jax.jit(jax.shard_map(lambda a, b, c: jtd.flash_decode(a, b, c, "x"),
                                     mesh=mesh, in_specs=(P(), P(None, "x"), P(None, "x")),
                                     out_specs=P("x")))
        lax = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(
            a[:, None], b, c, implementation="xla")[:, 0])
        ours_s = _time(ours, (q, *cache), iters)
        lax_s = _time(lax, (q, *cache), iters)
        nbytes = 2 * batch * seq * kv_heads * HEAD_DIM * jnp.dtype(dtype).itemsize
        rows.append({"bench": "decode", "seq": seq, "batch": batch, "heads": HEADS,
                     "kv_heads": kv_heads, "head_dim": HEAD_DIM,
                     "ours_us": None if ours_s is None else ours_s * 1e6,
                     "xla_us": None if lax_s is None else lax_s * 1e6,
                     "ours_gbps": None if ours_s is None else nbytes / ours_s / 1e9,
                     "vs_xla": lax_s / ours_s if ours_s and lax_s else None})
    return rows


def run(seqs: list[int], iters: int, causal: bool, platform: str | None
        ) -> list[dict[str, Any]]:
    return prefill(seqs, iters, causal, platform) + decode(seqs, iters, platform)


COLUMNS = {
    "prefill": [("seq", "seq", "d"), ("ours_fwd_us", "ours fwd us", ".1f"),
                ("xla_fwd_us", "xla fwd us", ".1f"), ("cudnn_fwd_us", "cudnn fwd us", ".1f"),
                ("ours_fwd_tflops", "ours fwd TF/s", ".0f"),
                ("fwd_vs_cudnn", "fwd vs cudnn", ".3f"),
                ("ours_bwd_us", "ours bwd us", ".1f"), ("cudnn_bwd_us", "cudnn bwd us", ".1f"),
                ("bwd_vs_cudnn", "bwd vs cudnn", ".3f")],
    "decode": [("seq", "cache", "d"), ("batch", "batch", "d"), ("ours_us", "ours us", ".1f"),
               ("xla_us", "xla us", ".1f"), ("ours_gbps", "ours GB/s", ".0f"),
               ("vs_xla", "xla/ours", ".3f")],
}
