"""Single-GPU costs of the runtime, each against its bare baseline:

* ``launch``: per-call cost of ``triton_call`` on a trivial kernel (a chain of calls in one
  jitted function) vs the same compiled kernel launched back to back with
  ``cuLaunchKernel`` on one stream. Both are slopes, ``(T(K) - T(1)) / (K - 1)``, so fixed
  costs (dispatch of the jitted function, synchronisation) cancel.
* ``copy``: a copy into the ``cuda`` SHMEM heap (memory mapped with cuMemCreate/cuMemMap)
  vs the same copy into a plain ``cuMemAlloc`` buffer; both device to device on the copy
  engine, synchronised.
* ``fused``: the fused GEMM ops at world size 1 (the fixed table's tiles and autotuned) vs
  ``jnp.dot`` and vs the project's bare GEMM tile with the table's tile shape; kernel-alone
  device times (``device_time``).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist.bench import device_time, gemm, timing
from jax_triton_dist.bench.accuracy import relative_error
from jax_triton_dist.runtime import cuda_compile, cuda_dispatch, cuda_driver
from jax_triton_dist.shmem import heap
from jax_triton_dist.tiles import gemm_configs

CHAIN = 200
COPY_SIZES = [1 << 20, 16 << 20, 256 << 20]
FUSED_SHAPES = [(8192, 1376, 4096), (8192, 4096, 1376), (8192, 3584, 8192), (128, 1376, 4096)]


@triton.jit
def bump_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``out = x + 1`` on ``n <= BLOCK`` elements: one program, next to no work."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def _slope(time_of, k: int) -> float:
    return (time_of(k) - time_of(1)) / (k - 1)


def launch_overhead(device, iters: int) -> list[dict[str, Any]]:
    mesh = Mesh(np.array([device]), ("x",))
    n = 256
    x = jax.device_put(jnp.zeros((n,), jnp.float32), NamedSharding(mesh, P()))

    def chain(k):
        def body(v):
            for _ in range(k):
                v = jtd.triton_call(bump_kernel, v, n=n, BLOCK=n, grid=(1,), axis_name="x",
                                    out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
                                    num_warps=1)
            return v

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(),
                                     check_vma=False))

    fns = {k: chain(k) for k in (1, CHAIN)}
    for k, f in fns.items():
        got = np.asarray(f(x))
        if not np.array_equal(got, np.full(n, k, np.float32)):
            raise RuntimeError(f"bump chain of {k} computed {got[:4]}..., expected {k}")
    ours = _slope(lambda k: timing.median_seconds(lambda: fns[k](x), iters), CHAIN)

    # The same kernel, compiled the same way, launched by the driver back to back.
    drv = cuda_driver.driver()
    ordinal = device.local_hardware_id
    positional = [("pointer", np.dtype(np.float32))] * 2 + [("scalar", n)]
    kwargs = {"BLOCK": n}
    signature, constexprs = cuda_compile.signature_of(bump_kernel, positional, kwargs)
    kernel = cuda_compile.compile_kernel(
        bump_kernel, signature, constexprs,
        attrs=cuda_compile.divisibility(signature, positional, kwargs), num_warps=1)
    _, function = drv.load_function(ordinal, kernel.asm["cubin"], kernel.metadata.name,
                                      kernel.metadata.shared)
    buf = drv.alloc(ordinal, 4 * n)
    stream = drv.stream_create(ordinal)
    values = [buf, buf] + ([n] if signature.get("n") != "constexpr" else [])

    def bare(k):
        samples = []
        for _ in range(iters + 2):
            start = time.perf_counter()
            drv.launch(ordinal, function, [1], 32, kernel.metadata.shared, values, stream,
                         repeat=k)
            drv.stream_synchronize(ordinal, stream)
            samples.append(time.perf_counter() - start)
        return float(np.median(samples[2:]))

    bare_s = _slope(bare, CHAIN)
    drv.stream_destroy(ordinal, stream)
    drv.free(ordinal, buf)
    return [{"bench": "launch", "what": "triton_call vs cuLaunchKernel, trivial kernel",
             "ours_us": ours * 1e6, "bare_us": bare_s * 1e6,
             "overhead_us": (ours - bare_s) * 1e6}]


def copy_bandwidth(device, iters: int) -> list[dict[str, Any]]:
    drv = cuda_driver.driver()
    ordinal = device.local_hardware_id
    cuda_dispatch.ensure_shmem(ordinal)
    rows = []
    for nbytes in COPY_SIZES:
        src = drv.alloc(ordinal, nbytes)
        plain = drv.alloc(ordinal, nbytes)
        offset = heap.reserve(nbytes, "the heap copy benchmark")
        dst = heap.heap_base(ordinal) + offset
        drv.write(ordinal, src, np.random.default_rng(0).bytes(min(nbytes, 1 << 20)))

        def timed(dst, src=src, nbytes=nbytes):
            samples = []
            for _ in range(iters + 2):
                start = time.perf_counter()
                heap.copy(ordinal, dst, src, nbytes)
                samples.append(time.perf_counter() - start)
            return float(np.median(samples[2:]))

        heap_s, plain_s = timed(dst), timed(plain)
        head = min(nbytes, 1 << 20)
        if drv.read(ordinal, dst, head) != drv.read(ordinal, src, head):
            raise RuntimeError("the copy into the symmetric heap lost data")
        rows.append({"bench": "copy", "bytes": nbytes, "heap_us": heap_s * 1e6,
                     "d2d_us": plain_s * 1e6, "heap_gbps": nbytes / heap_s / 1e9,
                     "d2d_gbps": nbytes / plain_s / 1e9, "ratio": plain_s / heap_s})
        heap.release(offset)
        drv.free(ordinal, src)
        drv.free(ordinal, plain)
    return rows


def _tuning(mode: str):
    """``$JTD_AUTOTUNE`` set to ``mode`` with no disk cache (each call site decides anew)."""
    saved = {k: os.environ.get(k) for k in ("JTD_AUTOTUNE", "JTD_AUTOTUNE_CACHE")}
    os.environ.update(JTD_AUTOTUNE=mode, JTD_AUTOTUNE_CACHE="")

    def restore() -> None:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return restore


# Layouts of the fused part: the weight ``[K, N]`` (``kn``) or stored ``[N, K]`` (``nk``:
# XLA's dot then contracts its dimension 1); ``batched``: ``x`` as ``[BATCH, M / BATCH, K]``
# (batch, sequence, model) with the gather / scatter along the sequence axis, ``[K, N]``
# weight.
LAYOUTS = ("kn", "nk", "batched")
BATCH = 8


def fused_overhead(device, iters: int, shapes=None, layouts=LAYOUTS) -> list[dict[str, Any]]:
    """Fused ops at world size 1 against the GEMM tile and XLA's dot, per layout
    (:data:`LAYOUTS`), each with the fixed table's tiles (``table``) and autotuned
    (``tuned``: on GPUs; on CPU the same as the table). Kernel-alone device times
    (``device_time``), bf16 in and out."""
    mesh = Mesh(np.array([device]), ("x",))
    rows = []
    for m, n, k in shapes or FUSED_SHAPES:
        rng = np.random.default_rng(1)
        put = lambda v: jax.device_put(jnp.asarray(v, jnp.bfloat16),  # noqa: E731
                                       NamedSharding(mesh, P()))
        a = put(rng.standard_normal((m, k), np.float32))
        b = put(rng.standard_normal((k, n), np.float32) / np.sqrt(k))
        ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
        table = gemm_configs(m, n, k)[0]
        tile = jax.jit(jax.shard_map(lambda x, y, c=table: gemm.matmul(x, y, c), mesh=mesh,
                                     in_specs=(P(), P()), out_specs=P(), check_vma=False))
        tile_s = device_time.kernel_seconds(tile, a, b, calls=iters).seconds
        for layout in layouts:
            if layout == "batched" and m % BATCH:
                continue
            nk = layout == "nk"
            weight = put(np.asarray(b, np.float32).T.copy()) if nk else b
            x = a.reshape(BATCH, m // BATCH, k) if layout == "batched" else a
            dims = (((x.ndim - 1,), (1 if nk else 0,)), ((), ()))
            dot = jax.jit(lambda x, y, d=dims: jax.lax.dot_general(x, y, d))
            dot_s = device_time.kernel_seconds(dot, x, weight, calls=iters).seconds
            axis = ({"all_gather_matmul": {"gather_axis": 1},
                     "matmul_reduce_scatter": {"scatter_dimension": 1}}
                    if layout == "batched" else {})
            for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
                op = functools.partial(getattr(jtd, name), w_layout="nk" if nk else "kn",
                                       **axis.get(name, {}))
                times = {}
                for mode in ("off", "gpu"):
                    restore = _tuning(mode)
                    try:
                        f = jax.jit(jax.shard_map(
                            lambda x, y, op=op: op(x, y, "x"), mesh=mesh,
                            in_specs=(P(), P()), out_specs=P(), check_vma=False))
                        times[mode] = device_time.kernel_seconds(f, x, weight,
                                                                 calls=iters).seconds
                    finally:
                        restore()
                out = f(x, weight).reshape(m, n)
                err = relative_error(out, ref)
                rows.append({"bench": "fused", "op": name, "shape": f"{m}x{n}x{k}",
                             "layout": layout, "ours_us": times["gpu"] * 1e6,
                             "table_us": times["off"] * 1e6, "tile_us": tile_s * 1e6,
                             "dot_us": dot_s * 1e6, "vs_dot": times["gpu"] / dot_s,
                             "table_vs_dot": times["off"] / dot_s,
                             "vs_tile": times["gpu"] / tile_s, "rel_err": err})
                # a run cut off (a device call's limit) still leaves the rows it measured
                print(f"fused: {name} {m}x{n}x{k} {layout}: tuned/dot {rows[-1]['vs_dot']:.3f}"
                      f", table/dot {rows[-1]['table_vs_dot']:.3f}, tuned/tile "
                      f"{rows[-1]['vs_tile']:.3f} (relative error {err:.1e})", flush=True)
    return rows


def run(iters: int, platform: str | None = None, parts=("launch", "copy", "fused"),
        shapes=None, layouts=LAYOUTS) -> dict[str, list[dict[str, Any]]]:
    device = jax.devices(platform)[0]
    if device.platform != "gpu" and set(parts) - {"fused"}:
        raise RuntimeError("the launch and copy parts need a GPU (JAX's devices are "
                           f"{device.platform}); on CPU only --parts fused runs (a smoke test)")
    results = {}
    if "launch" in parts:
        results["launch"] = launch_overhead(device, iters)
    if "copy" in parts:
        results["copy"] = copy_bandwidth(device, iters)
    if "fused" in parts:
        results["fused"] = fused_overhead(device, iters, shapes, layouts)
    return results


COLUMNS = {
    "launch": [("what", "", ""), ("ours_us", "ours us/call", ".2f"),
               ("bare_us", "bare us/call", ".2f"), ("overhead_us", "overhead us", ".2f")],
    "copy": [("bytes", "bytes", "d"), ("heap_us", "heap us", ".1f"), ("d2d_us", "d2d us", ".1f"),
             ("heap_gbps", "heap GB/s", ".0f"), ("d2d_gbps", "d2d GB/s", ".0f"),
             ("ratio", "heap/d2d", ".3f")],
    "fused": [("op", "op", ""), ("shape", "MxNxK", ""), ("layout", "w", ""),
              ("table_us", "table us", ".1f"), ("ours_us", "tuned us", ".1f"),
              ("tile_us", "tile us", ".1f"), ("dot_us", "jnp.dot us", ".1f"),
              ("table_vs_dot", "table/dot", ".3f"), ("vs_dot", "tuned/dot", ".3f"),
              ("vs_tile", "tuned/tile", ".3f"), ("rel_err", "rel err", ".1e")],
}

__all__ = ["run", "COLUMNS", "bump_kernel", "launch_overhead", "copy_bandwidth",
           "fused_overhead"]
