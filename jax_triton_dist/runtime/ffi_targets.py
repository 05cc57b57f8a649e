"""Registers the project's XLA FFI targets with JAX (done once, at package import)."""

from __future__ import annotations

import jax

from jax_triton_dist import _ffi

__all__ = ["register"]

_registered = False


def register() -> None:
    """Registers every FFI target of ``jax_triton_dist._ffi`` and the CPU dispatcher."""
    global _registered
    if _registered:
        return
    from jax_triton_dist.runtime import cpu_dispatch

    for name, capsule in _ffi.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    _ffi.set_cpu_dispatcher(cpu_dispatch.dispatch)
    _registered = True
