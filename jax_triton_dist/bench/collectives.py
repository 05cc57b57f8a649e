"""Collectives benchmark: ours vs jax.lax for every op, size and the current backend.

Times are per call in steady state (on GPUs, calls are dispatched back to back and the
host's dispatch overlaps the device's work). Algorithm bandwidth is the message size over
the time; bus bandwidth follows the NCCL tests' convention: bytes each rank must move over its
links per second (all-reduce: 2 (n - 1) / n of the message; all-gather, reduce-scatter,
all-to-all: (n - 1) / n of the full message).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist.bench import timing

# name: (ours, jax.lax reference, per-rank input elements for a message of n elements,
#        bus-bandwidth factor as a function of world)
OPS = {
    "all_gather": (lambda v: jtd.all_gather(v, "x", tiled=True),
                   lambda v: jax.lax.all_gather(v, "x", tiled=True),
                   lambda n, w: n // w, lambda w: (w - 1) / w),
    "reduce_scatter": (lambda v: jtd.reduce_scatter(v, "x", tiled=True),
                       lambda v: jax.lax.psum_scatter(v, "x", tiled=True),
                       lambda n, w: n, lambda w: (w - 1) / w),
    "all_reduce_one_shot": (lambda v: jtd.all_reduce(v, "x", method="one_shot"),
                            lambda v: jax.lax.psum(v, "x"),
                            lambda n, w: n, lambda w: 2 * (w - 1) / w),
    "all_reduce_two_shot": (lambda v: jtd.all_reduce(v, "x", method="two_shot"),
                            lambda v: jax.lax.psum(v, "x"),
                            lambda n, w: n, lambda w: 2 * (w - 1) / w),
    "all_to_all": (lambda v: jtd.all_to_all(v, "x", 0, 0, tiled=True),
                   lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True),
                   lambda n, w: n, lambda w: (w - 1) / w),
}


def run(sizes: list[int], ranks: int, dtype: str, iters: int,
        platform: str | None = None) -> list[dict[str, Any]]:
    """Times every op at every message size (bytes, the full message) on ``ranks`` devices
    of ``platform`` (default: JAX's default backend)."""
    devices = jax.devices(platform)
    if ranks > len(devices):
        raise ValueError(f"{ranks} ranks requested but only {len(devices)} "
                         f"{devices[0].platform} devices exist")
    mesh = Mesh(np.array(devices[:ranks]), ("x",))
    reps = 1 if devices[0].platform == "cpu" else 20
    dt = jnp.dtype(dtype)
    rows = []
    for size in sizes:
        n = max(ranks * ranks, size // dt.itemsize // (ranks * ranks) * ranks * ranks)
        for name, (ours, ref, per_rank, bus_factor) in OPS.items():
            elements = per_rank(n, ranks)
            x = jax.device_put(
                jnp.asarray(np.random.default_rng(0).standard_normal(ranks * elements), dt),
                NamedSharding(mesh, P("x")))
            times = {}
            for label, fn in (("ours", ours), ("lax", ref)):
                f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
                times[label] = timing.median_seconds(lambda f=f, x=x: f(x), iters, reps)
            message = n * dt.itemsize
            rows.append({
                "op": name, "bytes": message, "ranks": ranks, "dtype": dtype,
                "ours_us": times["ours"] * 1e6, "lax_us": times["lax"] * 1e6,
                "speedup": times["lax"] / times["ours"],
                "algbw_gbps": message / times["ours"] / 1e9,
                "busbw_gbps": message * bus_factor(ranks) / times["ours"] / 1e9,
            })
    return rows


COLUMNS = [
    ("op", "op", ""), ("bytes", "bytes", "d"), ("ranks", "ranks", "d"),
    ("ours_us", "ours us", ".1f"), ("lax_us", "jax.lax us", ".1f"),
    ("speedup", "lax/ours", ".3f"), ("algbw_gbps", "algbw GB/s", ".2f"),
    ("busbw_gbps", "busbw GB/s", ".2f"),
]
