"""Registers the project's XLA FFI targets with JAX (done once, at package import)."""

from __future__ import annotations

import jax

from jax_triton_dist import _ffi

__all__ = ["register"]

_registered = False


def register() -> None:
    """Registers the FFI targets (CPU; CUDA where the launcher was built) and their
    Python dispatchers. Probes no device: libcuda is loaded on the first CUDA launch."""
    global _registered
    if _registered:
        return
    from jax_triton_dist.runtime import cpu_dispatch, cuda_dispatch

    for name, capsule in _ffi.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    _ffi.set_cpu_dispatcher(cpu_dispatch.dispatch)
    launcher = cuda_dispatch.launcher()
    if launcher is not None:
        for name, capsule in launcher.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        launcher.set_planner(cuda_dispatch.plan)
    _registered = True
