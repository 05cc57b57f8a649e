"""CUDA driver calls of the runtime: module loading, module globals, device memory,
streams and direct launches (the ``_cuda_driver`` extension).

The planner (:mod:`~jax_triton_dist.runtime.cuda_dispatch`) loads kernels and writes rank
contexts with them; :mod:`jax_triton_dist.one_gpu` and the benchmarks launch kernels
directly. The extension is built where the CUDA headers are found and loads libcuda at
run time, so importing this module never needs a GPU.

Example::

    drv = cuda_driver.driver()          # RuntimeError without a driver and a GPU
    buf = drv.alloc(0, 1 << 20)
    drv.free(0, buf)
"""

from __future__ import annotations

from types import ModuleType

try:  # built only where the CUDA headers were found
    from jax_triton_dist import _cuda_driver as _ext
except ImportError:  # pragma: no cover - depends on the build machine
    _ext = None

__all__ = ["built", "available", "unavailable_reason", "driver"]


def built() -> bool:
    """Whether this build has the CUDA driver calls (the CUDA headers were found)."""
    return _ext is not None


def available() -> bool:
    """Whether an NVIDIA driver and a GPU are usable."""
    return _ext is not None and _ext.available()


def unavailable_reason() -> str:
    """Why :func:`available` is false ("" when it is true)."""
    if _ext is None:
        return "jax_triton_dist was built without the CUDA headers (no CUDA launcher)"
    return "" if _ext.available() else _ext.unavailable_reason()


def driver() -> ModuleType:
    """The driver calls (``alloc``, ``free``, ``read``, ``write``, ``copy_async``,
    ``load_function``, ``module_global``, ``resident_programs``, ``stream_create``,
    ``stream_destroy``, ``stream_synchronize``, ``stream_query``, ``stream_wait_value``,
    ``device_synchronize``, ``event_create``,
    ``event_record``, ``event_elapsed_ms``, ``event_destroy``, ``launch``, ``device_count``).

    Raises:
      RuntimeError: no usable driver and GPU (the message says why).
    """
    if not available():
        raise RuntimeError(f"CUDA is not available: {unavailable_reason()}")
    return _ext
