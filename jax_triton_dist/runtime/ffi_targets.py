"""Registers the project's XLA FFI targets with JAX (once, when the first ``triton_call``
is traced).

The target has an instantiate stage whose state type XLA must know before the target:
JAX registers targets deferred until a backend starts before the types deferred with
them, so registration waits until the backends run (``jax.devices()``) and then registers
each type before its target."""

from __future__ import annotations

import atexit

import jax

from jax_triton_dist import _ffi

__all__ = ["register"]

_registered = False


def register() -> None:
    """Registers the FFI targets (CPU; CUDA where the launcher was built) and their
    Python dispatchers; starts JAX's backends if they are not running. Loads no CUDA
    library itself: libcuda is loaded on the first CUDA launch."""
    global _registered
    if _registered:
        return
    jax.devices()  # the backends run: registrations below take effect in their order
    from jax_triton_dist.runtime import cpu_dispatch, cuda_dispatch, site_uses

    # The type of the state the targets' instantiate stage gives XLA (one per executable
    # and device: how the runtime learns that an executable is gone).
    jax.ffi.register_ffi_type("jtd_site_use", _ffi.site_use_type(), platform="cpu")
    for name, stages in _ffi.registrations().items():
        jax.ffi.register_ffi_target(name, stages, platform="cpu")
    # Exit hooks first (they run before SHMEM's, which frees the heaps): from now on a
    # program may reach a custom call at any moment, the interpreter's exit included.
    atexit.register(cpu_dispatch.close_at_exit)
    _ffi.set_cpu_dispatcher(cpu_dispatch.dispatch)
    site_uses.add_log(_ffi.take_site_events)
    launcher = cuda_dispatch.launcher()
    if launcher is not None:
        jax.ffi.register_ffi_type("jtd_site_use", launcher.site_use_type(), platform="CUDA")
        for name, stages in launcher.registrations().items():
            jax.ffi.register_ffi_target(name, stages, platform="CUDA")
        atexit.register(launcher.close, cuda_dispatch.EXIT_GRACE_S)  # no plan in Python then
        launcher.set_planner(cuda_dispatch.plan)
        launcher.set_launch_logger(cuda_dispatch.log_launch)
        site_uses.add_log(launcher.take_site_events)
    _registered = True
