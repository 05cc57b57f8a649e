"""jax_triton_dist: distributed Triton kernels as XLA FFI custom calls for JAX.

Public API:

* :func:`triton_call`, :class:`Workspace` — launch a distributed Triton kernel inside
  ``jax.shard_map``;
* :func:`all_gather`, :func:`reduce_scatter`, :func:`all_reduce`, :func:`all_to_all` —
  drop-in replacements for the ``jax.lax`` collectives, and :mod:`jax_triton_dist.lax`,
  the same under ``jax.lax``'s names (``psum``, ``pmean``, ``psum_scatter``, ...);
* :func:`sequence_parallel_attention`, :func:`flash_decode` — attention across ranks
  (:mod:`jax_triton_dist.attention`);
* :func:`all_gather_matmul`, :func:`matmul_reduce_scatter`, :func:`matmul_all_reduce` —
  GEMM and collective fused in one kernel; :func:`fuse` — the same for unmodified
  ``jax.lax`` code;
* :mod:`jax_triton_dist.language` (``dl``) — the kernel language;
* :mod:`jax_triton_dist.shmem` — the host SHMEM API;
* :func:`heap_usage`, :func:`check_errors` — the runtime's heap use, asynchronous GPU
  failures;
* :mod:`jax_triton_dist.timeline` — intra-kernel timelines as Chrome traces;
  :mod:`jax_triton_dist.testing` — a pytest plugin for distributed kernels;
  ``python -m jax_triton_dist doctor`` and ``python -m jax_triton_dist.stress``.
"""

import importlib.util as _importlib_util
import os as _os

if _importlib_util.find_spec("jax_triton_dist._shmem") is None:
    # Python found this package in a directory without the built extensions, most often
    # the repository root (the current directory comes first on sys.path) shadowing the
    # installed package.
    raise ImportError(
        f"jax_triton_dist was imported from {_os.path.dirname(__file__)}, which holds no "
        "built extension (_shmem). If that is a source checkout and the package is "
        "installed, run from another directory (Python puts the current directory first "
        "on sys.path); otherwise install it: pip install .")

from jax_triton_dist import attention, autotune, lax, shmem, timeline  # noqa: E402
from jax_triton_dist.attention import flash_decode, sequence_parallel_attention  # noqa: E402
from jax_triton_dist.collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from jax_triton_dist.fuse import fuse
from jax_triton_dist.fused import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from jax_triton_dist.moe import MoERouting, moe_combine, moe_dispatch
from jax_triton_dist.status import Usage, check_errors, heap_usage
from jax_triton_dist.triton_call import SUPPORTED_DTYPES, Workspace, axis_size, triton_call

__all__ = [
    "triton_call", "Workspace", "SUPPORTED_DTYPES", "axis_size", "shmem", "lax", "timeline",
    "autotune", "attention", "sequence_parallel_attention", "flash_decode",
    "all_gather", "reduce_scatter", "all_reduce", "all_to_all",
    "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "fuse",
    "moe_dispatch", "moe_combine", "MoERouting", "heap_usage", "Usage", "check_errors",
]
__version__ = "0.1.0"
