"""``python -m jax_triton_dist doctor``: what this installation has, and proof that it works.

Prints the versions (and what the extensions were built with), the platform and devices,
the SHMEM backend that would be chosen and why, the heap and wait settings, whether libcuda,
NVSHMEM's host library and a device bitcode Triton can read are found, whether an Ascend
compiler environment is found; then runs a small ``all_reduce`` and a ``triton_call`` ring
kernel on the local devices and compares them with ``jax.lax``. Every failed check says
what to do. The exit status is 0 only when everything the current platform needs works
(checks of other platforms are reported, not required).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable

__all__ = ["Check", "run", "main"]

TRITON_VERSION = "3.6.0"
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass
class Check:
    """One line of the report."""

    name: str
    status: str  # "ok", "fail", "warn" (works, but worth knowing), "info", "skip"
    detail: str
    fix: str = ""
    required: bool = True  # a failure makes the exit status non-zero

    def line(self) -> str:
        mark = {"ok": "ok  ", "fail": "FAIL", "warn": "warn", "info": "    ",
                "skip": "skip"}[self.status]
        text = f"[{mark}] {self.name:<26} {self.detail}"
        if self.fix and self.status in ("fail", "warn", "info"):
            text += f"\n       {'':<26} -> {self.fix}"
        return text


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _versions() -> list[Check]:
    import jax
    import jaxlib
    import numpy

    checks = [Check("python", "info", f"{platform.python_version()} ({sys.executable})"),
              Check("jax / jaxlib", "info", f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"),
              Check("numpy", "info", numpy.__version__)]
    triton = _version("triton")
    checks.append(Check(
        "triton", "ok" if triton == TRITON_VERSION else "fail", str(triton),
        f"pip install triton=={TRITON_VERSION} (the dl lowering and the interpreter patches "
        f"are written for it; triton-ascend belongs in its own environment)"))
    checks.append(Check("jax_triton_dist", "info",
                        f"{_version('jax_triton_dist')} at "
                        f"{os.path.dirname(os.path.abspath(__file__))}"))
    return checks


def _extensions(gpu: bool) -> list[Check]:
    checks = []
    for name, needed in (("_shmem", True), ("_ffi", True), ("_cuda", gpu), ("_cuda_driver", gpu)):
        try:
            importlib.import_module(f"jax_triton_dist.{name}")
            checks.append(Check(f"extension {name}", "ok", "imports", required=needed))
        except ImportError as error:
            fix = ("reinstall: pip install --no-build-isolation . (needs a C++17 compiler and "
                   "CMake)" if name in ("_shmem", "_ffi") else
                   "rebuild where the CUDA headers are found (nvcc / CUDA toolkit on PATH or "
                   "CUDAToolkit_ROOT)")
            checks.append(Check(f"extension {name}", "fail" if needed else "info",
                                f"missing ({error})", fix, required=needed))
    try:
        from jax_triton_dist import _build_info as b

        built = (f"{b.COMPILER}, Python {b.PYTHON}, nanobind {b.NANOBIND}, XLA FFI of jaxlib "
                 f"{b.JAXLIB}, CUDA {b.CUDA or 'none'}, NVSHMEM headers "
                 f"{'yes' if b.NVSHMEM_INCLUDE_DIR else 'no'}")
        import jaxlib

        status, fix = "info", ""
        if b.JAXLIB and b.JAXLIB.split(".")[:2] != jaxlib.__version__.split(".")[:2]:
            status = "warn"
            fix = (f"built against jaxlib {b.JAXLIB}, running {jaxlib.__version__}: XLA's FFI "
                   "is versioned and usually compatible; rebuild if custom calls fail")
        checks.append(Check("built with", status, built, fix, required=False))
    except ImportError:
        checks.append(Check("built with", "info", "unknown (no _build_info: a development "
                            "build)", required=False))
    return checks


def _platform() -> tuple[list[Check], str]:
    import jax

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    name = devices[0].platform
    checks = [Check("platform", "info", f"{name}: {len(devices)} device(s) ({', '.join(kinds)})"
                    f", {jax.process_count()} process(es)")]
    if name == "cpu" and len(devices) < 2:
        checks.append(Check("CPU devices", "warn", "1 CPU device: distributed kernels run "
                            "with one rank", f"set XLA_FLAGS={_DEVICE_FLAG}=8 before JAX "
                            "starts to simulate 8 ranks", required=False))
    return checks, name


def _shmem_settings(name: str) -> list[Check]:
    import jax

    from jax_triton_dist.runtime import debug_settings
    from jax_triton_dist.shmem import lifetime, settings

    checks = []
    try:
        backend = lifetime.default_backend()
        env = settings.backend_from_env()
        if env:
            why = f"${settings.BACKEND_ENV}={env}"
        elif name == "cpu":
            why = "JAX's default platform is the CPU"
        elif jax.process_count() > 1 and jax.local_device_count() == 1:
            why = "a multi-process job with one GPU per process"
        else:
            why = f"one process driving its {jax.local_device_count()} GPU(s)"
        available = lifetime.available_backends()
        fix = ""
        if backend not in available:
            fix = (f"this build lacks {backend!r}: rebuild with its headers, or set "
                   f"{settings.BACKEND_ENV}")
        elif (name == "cpu") != (backend == "host"):
            fix = (f"{name.upper()} devices run kernels on the "
                   f"{'host' if name == 'cpu' else 'cuda or nvshmem'} backend: unset "
                   f"{settings.BACKEND_ENV}")
        checks.append(Check("SHMEM backend", "fail" if fix else "ok",
                            f"{backend} ({why}); this build has {', '.join(available)}", fix))
        default = {"host": settings.DEFAULT_HEAP_SIZE, "cuda": settings.DEFAULT_GPU_HEAP_SIZE,
                   "nvshmem": settings.DEFAULT_NVSHMEM_HEAP_SIZE}[backend]
        size = settings.heap_size_or_default(None, default)
        source = (f"${settings.HEAP_SIZE_ENV}" if os.environ.get(settings.HEAP_SIZE_ENV)
                  else "default")
        checks.append(Check("heap", "ok", f"{size / 2**20:.0f} MiB per PE ({source}); waits "
                            f"time out after {settings.wait_timeout():g} s"))
    except ValueError as error:
        checks.append(Check("settings", "fail", str(error), "fix or unset the variable"))
    try:
        debug_settings.check_environment()
        on = [v for v in (debug_settings.DUMP_IR_ENV, debug_settings.LOG_ENV,
                          debug_settings.TIMELINE_ENV) if os.environ.get(v)]
        checks.append(Check("debug settings", "ok", ", ".join(f"{v}={os.environ[v]}" for v in on)
                            or "none set"))
    except ValueError as error:
        checks.append(Check("debug settings", "fail", str(error), "fix or unset the variable"))
    return checks


def _cuda(gpu: bool) -> list[Check]:
    from jax_triton_dist.runtime import cuda_driver

    if cuda_driver.available():
        return [Check("libcuda", "ok", "driver loaded, GPU visible", required=gpu)]
    return [Check("libcuda", "fail" if gpu else "info",
                  f"not usable: {cuda_driver.unavailable_reason()}",
                  "install the NVIDIA driver (libcuda.so.1) and make a GPU visible",
                  required=gpu)]


def _nvshmem(needed: bool) -> list[Check]:
    from jax_triton_dist.shmem import nvshmem_bootstrap

    try:
        path = nvshmem_bootstrap.library_path()
    except Exception as error:  # ShmemError: the wheel is not installed
        return [Check("NVSHMEM host library", "fail" if needed else "info", str(error),
                      "pip install nvidia-nvshmem-cu13 (one process per GPU jobs need it)",
                      required=needed)]
    if not os.path.exists(path):
        return [Check("NVSHMEM host library", "fail" if needed else "info", f"{path} missing",
                      "pip install nvidia-nvshmem-cu13, or set JTD_NVSHMEM_LIB",
                      required=needed)]
    checks = [Check("NVSHMEM host library", "ok", path, required=needed)]
    bitcode = nvshmem_bootstrap.device_library_path()
    if bitcode is None:
        checks.append(Check("NVSHMEM device bitcode", "info", "not found next to the host "
                            "library (dl.nvshmem calls unavailable)", required=False))
        return checks
    try:
        _compile_nvshmem_call(bitcode)
        checks.append(Check("NVSHMEM device bitcode", "ok", f"{bitcode} (Triton links it)",
                            required=False))
    except Exception as error:  # Triton cannot parse newer LLVM bitcode
        checks.append(Check("NVSHMEM device bitcode", "warn",
                            f"{bitcode}: {str(error).splitlines()[0][:160]}",
                            "dl.nvshmem calls need NVSHMEM 3.4.5's bitcode with Triton 3.6 "
                            "(pip install nvidia-nvshmem-cu13==3.4.5); the other dl calls "
                            "are unaffected", required=False))
    return checks


def _compile_nvshmem_call(bitcode: str) -> None:
    import numpy as np
    import triton
    import triton.language as tl

    import jax_triton_dist.language as dl
    from jax_triton_dist.runtime import cuda_compile

    @triton.jit
    def nvshmem_pe_kernel(out_ptr):
        tl.store(out_ptr, dl.nvshmem.my_pe())

    signature, constexprs = cuda_compile.signature_of(
        nvshmem_pe_kernel, [("pointer", np.dtype(np.int32))], {})
    cuda_compile.compile_kernel(nvshmem_pe_kernel, signature, constexprs,
                                nvshmem_device_lib=bitcode)


def _ascend() -> list[Check]:
    from jax_triton_dist.ascend.__main__ import INSTALL_LINE, ascend_python

    python = ascend_python()
    if python is None:
        return [Check("Ascend compiler", "info", "no triton-ascend environment found "
                      "(--python, $JTD_ASCEND_PYTHON, ./.venv-ascend)",
                      f"for the Ascend lowering: {INSTALL_LINE}", required=False)]
    return [Check("Ascend compiler", "ok", f"triton-ascend environment at {python} "
                  "(lowering to HIVM IR; no NPU run)", required=False)]


def _smoke(name: str, fn: Callable[[], str], verbose: bool) -> Check:
    start = time.perf_counter()
    try:
        detail = fn()
        return Check(name, "ok", f"{detail} ({time.perf_counter() - start:.1f} s)")
    except Exception as error:
        lines = [line for line in str(error).splitlines() if line.strip()]
        message = next((line for line in lines if "jax_triton_dist" in line),
                       lines[0] if lines else "")
        fix = "JTD_LOG=launch shows the plans and launches; --verbose the traceback"
        if verbose:
            fix += "\n" + traceback.format_exc()
        return Check(name, "fail", f"{type(error).__name__}: {message[:400]}", fix)


def _mesh():
    import jax
    import numpy as np

    devices = jax.devices()
    return jax.sharding.Mesh(np.array(devices), ("x",)), len(devices)


def _all_reduce_check() -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jax_triton_dist as jtd

    mesh, n = _mesh()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((n * 8, 128)), jnp.float32)
    ours = jax.jit(jax.shard_map(lambda v: jtd.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"),
                                 out_specs=P()))(x)
    want = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                                 out_specs=P()))(x)
    err = float(jnp.max(jnp.abs(ours - want)))
    if err > 1e-4:
        raise AssertionError(f"all_reduce over {n} ranks differs from jax.lax.psum by {err}")
    return f"all_reduce over {n} rank(s) matches jax.lax.psum (max err {err:.1e})"


def _ring_check() -> str:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jax_triton_dist as jtd
    from jax_triton_dist.kernels.ring_exchange import ring_shift_kernel

    mesh, n = _mesh()
    size = 1000

    def ring(v):
        return jtd.triton_call(
            ring_shift_kernel, v, n=size, out_shape=jax.ShapeDtypeStruct((size,), v.dtype),
            workspace=[jtd.Workspace((2, size), v.dtype), jtd.Workspace((2,), jnp.int32)],
            grid=(1,), axis_name="x", BLOCK=256)

    x = jnp.arange(n * size, dtype=jnp.float32)
    out = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
    want = jnp.roll(x.reshape(n, size), 1, axis=0).reshape(-1)
    if not bool(jnp.array_equal(out, want)):
        raise AssertionError("the ring kernel's result is not each rank's left neighbour's data")
    return f"ring kernel over {n} rank(s): each rank got its neighbour's data"


def run(verbose: bool = False) -> list[Check]:
    """Every check, in report order."""
    checks = _versions()
    plat_checks, name = _platform()
    gpu = name == "gpu"
    checks += _extensions(gpu) + plat_checks + _shmem_settings(name) + _cuda(gpu)
    import jax

    checks += _nvshmem(gpu and jax.process_count() > 1) + _ascend()
    blocking = [c for c in checks if c.status == "fail" and c.required]
    if blocking:
        checks.append(Check("smoke tests", "skip", "not run: fix the failures above first",
                            required=False))
        return checks
    checks.append(_smoke("all_reduce", _all_reduce_check, verbose))
    checks.append(_smoke("triton_call ring kernel", _ring_check, verbose))
    return checks


def main(verbose: bool = False) -> int:
    """Prints the report; returns the exit status."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = bool(bridge is not None and getattr(bridge, "_backends", None))
    if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", "") and not started:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}=4".strip()
        print(f"doctor: set XLA_FLAGS={_DEVICE_FLAG}=4 (4 simulated CPU devices, used if JAX "
              "runs on the CPU)")
    checks = run(verbose)
    print("jax_triton_dist doctor")
    for check in checks:
        print(check.line())
    failed = [c for c in checks if c.status == "fail" and c.required]
    print(f"\n{len(failed)} required check(s) failed" if failed else
          "\neverything this platform needs works")
    return 1 if failed else 0
