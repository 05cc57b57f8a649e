"""GEMM-tile benchmark: the project's Triton GEMM (``kernels/gemm.py``, launched through
``triton_call`` on one device) against XLA's ``jnp.dot`` (cuBLAS on NVIDIA GPUs).

Kernel-alone timing for both (``device_time``: the profiler's GPU kernel durations of
single jitted calls on the same operands, bf16 in and out), so neither side pays for
dispatch or slicing. Every config of the autotuner's space for the shape
(``tiles.gemm_configs``: the fixed table's first, then tile shapes and persistent
variants, each also with tensor descriptors, the persistent ones also flattened;
``tiles.split_k_configs`` for decode shapes; ``tiles.stream_k_configs`` where tiles leave
a partial last wave: ``tiles.gemm_tile_configs``) is timed; the table reports the fixed
table's config, the best config (what the autotuner would choose: it minimises the same
kernel time) and XLA. Flattened, TMA-store and stream-K configs are the tile kernel's
alone: the fused ops do not have them, so such a winner is ahead of what the ops run.

Where PyTorch with a GPU is installed, the same product through PyTorch's cuBLAS
(``torch.matmul``) is timed too (:func:`cublas_seconds`: a CUDA graph of ``iters``
products replayed between two CUDA events, per product — launch gaps inside a graph are
about a microsecond, so this is close to, not the same as, the profiler's kernel time).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist import tiles
from jax_triton_dist.bench import device_time
from jax_triton_dist.bench.accuracy import relative_error
from jax_triton_dist.kernels.gemm import (
    matmul_kernel,
    matmul_split_k_kernel,
    matmul_stream_k_kernel,
)

# (M, N, K): 8192^3, and the per-rank shapes of a TP8 Llama-style MLP, including decode.
SHAPES = [(8192, 8192, 8192), (8192, 1376, 4096), (8192, 4096, 1376), (8192, 3584, 8192),
          (128, 1376, 4096)]


def matmul(a, b, config: dict[str, Any], axis_name="x", programs: int | None = None):
    """``a @ b`` with the project's GEMM kernel and one config of ``tiles.gemm_configs``,
    ``tiles.split_k_configs`` or ``tiles.stream_k_configs`` (per rank, inside shard_map).
    ``programs``: the grid of a persistent or stream-K config (default
    ``tiles.fill_programs()``)."""
    config = dict(config)
    warps, stages = config.pop("num_warps"), config.pop("num_stages")
    (m, k), (_, n) = a.shape, b.shape
    tile_count = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    programs = programs or tiles.fill_programs()
    workspace, co_resident = [], False
    if config.pop("STREAM_K", False):
        config.pop("PERSISTENT")  # stream-K is always persistent
        kernel, grid = matmul_stream_k_kernel, programs
        slots = tiles.stream_k_slots(programs, tile_count, triton.cdiv(k, config["BLOCK_K"]),
                                     config.get("IN_STEP", False))
        if config.get("IN_STEP"):
            config["SLOTS"] = slots
        workspace = [jtd.Workspace((programs, slots, config["BLOCK_M"], config["BLOCK_N"]),
                                   jnp.float32), jtd.Workspace((tile_count,), jnp.int32)]
    elif "SPLIT_K" in config:
        kernel, grid = matmul_split_k_kernel, tile_count * config["SPLIT_K"]
        workspace = [jtd.Workspace((m, n), jnp.float32),
                     jtd.Workspace((tile_count,), jnp.int32)]
    else:
        co_resident = bool(config["PERSISTENT"])
        kernel, grid = matmul_kernel, min(tile_count, programs) if co_resident else tile_count
    return jtd.triton_call(
        kernel, a, b, M=m, N=n, K=k, stride_am=k, stride_ak=1, stride_bk=n, stride_bn=1,
        stride_cm=n, stride_cn=1, out_shape=jax.ShapeDtypeStruct((m, n), a.dtype),
        workspace=workspace, grid=(grid,), axis_name=axis_name, num_warps=warps,
        num_stages=stages, co_resident=co_resident, **config)


def describe(config: dict[str, Any]) -> str:
    """``128x128x64 w8 s3`` (+ `` persistent``, `` TMA`` or `` stream-K`` [`` in-step``];
    `` flattened``, `` WS`` (warp-specialized), `` TMA store`` [`` halves``]; or
    `` split-K n``)."""
    text = (f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} "
            f"w{config['num_warps']} s{config['num_stages']}")
    if config.get("SPLIT_K"):
        return text + f" split-K {config['SPLIT_K']}"
    forms = ((" stream-K" + (" in-step" if config.get("IN_STEP") else "")
              + ("" if config["USE_TMA"] else " pointers")
              if config.get("STREAM_K") else
              (" persistent" if config["PERSISTENT"] else "")
              + (" TMA" if config.get("USE_TMA") else ""))
             + (" flattened" if config.get("FLATTEN") else "")
             + (" WS" if config.get("WARP_SPECIALIZE") else "")
             + (" TMA store" if config.get("TMA_STORE") else "")
             + (" halves" if config.get("SUBTILE") else ""))
    return text + forms


def cublas_seconds(m: int, n: int, k: int, dtype: str, iters: int) -> float | None:
    """Seconds per ``[m, k] @ [k, n]`` product by cuBLAS through PyTorch: ``iters``
    ``torch.matmul`` calls captured in a CUDA graph, the graph replayed three times between
    CUDA events, the median per product. None where PyTorch or a GPU for it is missing, or
    it fails (the reason is printed)."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        dt = getattr(torch, dtype)
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn((m, k), device="cuda", generator=gen).to(dt)
        b = (torch.randn((k, n), device="cuda", generator=gen) / k ** 0.5).to(dt)
        c = torch.empty((m, n), device="cuda", dtype=dt)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: cuBLAS picks its kernel
            for _ in range(3):
                torch.matmul(a, b, out=c)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                torch.matmul(a, b, out=c)
        graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(3):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / iters)
        return float(np.median(samples))
    except Exception as error:  # an optional comparison: say why it is missing
        print(f"  {m}x{n}x{k}: no cuBLAS time through PyTorch: {type(error).__name__}: "
              f"{str(error)[:200]}")
        return None


# A config whose result is this far from the float32 reference (relative Frobenius error)
# computed a wrong product: it is reported, never chosen. Right ones are ~2e-3 in bf16.
WRONG = 1e-2


def run(shapes: list[tuple[int, int, int]], iters: int, dtype: str = "bfloat16",
        platform: str | None = None, only: list[str] | None = None) -> list[dict[str, Any]]:
    """Times every shape with every config and ``jnp.dot``; one row per shape. ``only``:
    just the configs whose :func:`describe` contains one of these texts, and the fixed
    table's (the best is then the best of those). The best is the fastest config whose
    result is right (relative error below :data:`WRONG`); the wrong ones are printed and
    listed in the row's ``wrong``."""
    device = jax.devices(platform)[0]
    mesh = Mesh(np.array([device]), ("x",))
    dt = jnp.dtype(dtype)
    rows = []
    for m, n, k in shapes:
        rng = np.random.default_rng(0)
        put = lambda x: jax.device_put(jnp.asarray(x, dt), NamedSharding(mesh, P()))  # noqa: E731
        a = put(rng.standard_normal((m, k), np.float32))
        b = put(rng.standard_normal((k, n), np.float32) / np.sqrt(k))
        xla = jax.jit(jnp.dot)
        xla_time = device_time.kernel_seconds(xla, a, b, calls=iters)
        ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
        timed = []
        space = tiles.gemm_tile_configs(m, n, k)
        for config in [c for i, c in enumerate(space)
                       if i == 0 or not only or any(t in describe(c) for t in only)]:
            f = jax.jit(jax.shard_map(lambda x, y, c=config: matmul(x, y, c), mesh=mesh,
                                      in_specs=(P(), P()), out_specs=P(), check_vma=False))
            try:
                seconds = device_time.kernel_seconds(f, a, b, calls=iters).seconds
            except Exception as error:  # a config that does not fit (shared memory, SMs)
                print(f"  {m}x{n}x{k} {describe(config)}: {type(error).__name__}: "
                      f"{str(error)[:300]}")
                continue
            timed.append((seconds, config, relative_error(f(a, b), ref)))
            if timed[-1][2] >= WRONG:
                print(f"  {m}x{n}x{k} {describe(config)}: WRONG RESULT (relative error "
                      f"{timed[-1][2]:.2g}): left out of the best")
        right = [t for t in timed if t[2] < WRONG]
        if not right:
            raise RuntimeError(f"no GEMM configuration ran and gave the right product for "
                               f"{m}x{n}x{k}")
        table = timed[0] if timed[0][1] == tiles.gemm_configs(m, n, k)[0] else None
        best = min(right, key=lambda t: t[0])
        cublas = cublas_seconds(m, n, k, dtype, iters) if device.platform == "gpu" else None
        flops = 2.0 * m * n * k
        rows.append({
            "shape": f"{m}x{n}x{k}", "dtype": dtype, "timing": xla_time.source,
            "xla_us": xla_time.seconds * 1e6, "xla_kernels": xla_time.kernels,
            "table_us": table[0] * 1e6 if table else float("nan"),
            "best_us": best[0] * 1e6, "best_config": describe(best[1]),
            "ratio": xla_time.seconds / best[0],
            "table_ratio": xla_time.seconds / table[0] if table else float("nan"),
            "best_tflops": flops / best[0] / 1e12, "xla_tflops": flops / xla_time.seconds / 1e12,
            "cublas_us": cublas * 1e6 if cublas else float("nan"),
            "cublas_ratio": cublas / best[0] if cublas else float("nan"),
            "rel_err": best[2],
            "configs": [{"config": describe(c), "us": s * 1e6, "rel_err": e}
                        for s, c, e in timed],
            "wrong": [describe(c) for _, c, e in timed if e >= WRONG],
        })
    return rows


COLUMNS = [("shape", "MxNxK", ""), ("table_us", "table us", ".1f"), ("best_us", "tuned us", ".1f"),
           ("xla_us", "jnp.dot us", ".1f"), ("table_ratio", "xla/table", ".3f"),
           ("ratio", "xla/tuned", ".3f"), ("best_tflops", "tuned TF/s", ".0f"),
           ("xla_tflops", "dot TF/s", ".0f"), ("cublas_us", "torch cuBLAS us", ".1f"),
           ("cublas_ratio", "cuBLAS/tuned", ".3f"), ("best_config", "tuned config", ""),
           ("rel_err", "rel err", ".1e")]
