"""``triton_call``: a distributed Triton kernel as an XLA custom call inside ``shard_map``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_triton_dist import axis_names, dtypes
from jax_triton_dist.compiler_axes import every_axis_manual
from jax_triton_dist.language import bounds
from jax_triton_dist.runtime import (
    call_site,
    debug_settings,
    ffi_targets,
    jax_compat,
    site_uses,
    timeline_capture,
    tuning,
)
from jax_triton_dist.shmem import settings

__all__ = ["triton_call", "Workspace", "SUPPORTED_DTYPES", "axis_size"]

TARGET = "jtd_triton"

SUPPORTED_DTYPES = dtypes.KERNEL_DTYPES
"""Element types a kernel argument or result may have."""


class Workspace:
    """A per-rank symmetric scratch buffer that ``triton_call`` passes to the kernel.

    Workspaces live in the SHMEM heap (so peers can reach them with ``dl.symm_at``),
    are zero when a call site first runs, and keep their contents between calls.

    Args:
      shape: per-rank shape.
      dtype: element type.
    """

    def __init__(self, shape: int | Sequence[int], dtype: Any):
        self.spec = call_site.ArraySpec(_shape(shape, "Workspace"), _dtype(dtype, "Workspace"))

    def __repr__(self) -> str:
        return f"Workspace({self.spec.shape}, {self.spec.dtype})"


def _shape(shape: int | Sequence[int], what: str) -> tuple[int, ...]:
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
        raise ValueError(f"{what}: shape must be non-negative integers, got {shape}")
    return tuple(int(d) for d in shape)


def _dtype(dtype: Any, what: str) -> np.dtype:
    return dtypes.check_dtype(dtype, SUPPORTED_DTYPES, what)


def axis_size(axis_name: Any) -> int:
    """Devices along ``axis_name`` (a manual mesh axis or a tuple of them: the product of
    their sizes) in the enclosing ``shard_map``.

    Raises:
      ValueError: not inside ``shard_map``, or no such manual axis.
    """
    return axis_names.axis_size(axis_name)


def _kernel_label(kernel: Any) -> str:
    fn = getattr(kernel, "fn", None)
    if fn is None or not callable(fn):
        raise TypeError(f"triton_call: expected a @triton.jit kernel, got {type(kernel).__name__}")
    return fn.__name__


def _check_signature(kernel: Any, n_positional: int, kwargs: dict[str, Any], label: str) -> None:
    params = list(inspect.signature(kernel.fn).parameters)
    if n_positional > len(params):
        raise TypeError(
            f"triton_call: kernel {label} takes {len(params)} parameters, but {n_positional} "
            "positional arguments (inputs, outputs, workspaces) are passed"
        )
    unknown = sorted(set(kwargs) - set(params[n_positional:]))
    if unknown:
        raise TypeError(f"triton_call: kernel {label} has no parameters {unknown} left to bind "
                        f"(its parameters: {params})")
    signature = inspect.signature(kernel.fn).parameters
    missing = [name for name in params[n_positional:] if name not in kwargs
               and signature[name].default is inspect.Parameter.empty]
    if missing:
        raise TypeError(f"triton_call: kernel {label}: no value for parameter(s) "
                        f"{', '.join(missing)} (pass them as keyword arguments, e.g. "
                        f"{missing[0]}=...)")


def _workspaces(workspace: Any, variants: Sequence[tuning.Variant],
                label: str) -> list[call_site.ArraySpec]:
    """Per-rank workspace specs: the largest any variant needs (``workspace`` may be a
    function of the keyword arguments, as ``grid`` may)."""
    per_variant = []
    for variant in variants:
        entries = list(workspace(variant.kwargs) if callable(workspace) else workspace)
        if any(not isinstance(w, Workspace) for w in entries):
            raise TypeError("triton_call: workspace entries must be jax_triton_dist.Workspace")
        per_variant.append([w.spec for w in entries])
    first = per_variant[0]
    for specs in per_variant[1:]:
        if [s.dtype for s in specs] != [s.dtype for s in first]:
            raise ValueError(f"triton_call: kernel {label}: every config must have the same "
                             f"number and dtypes of workspaces, got {first} and {specs}")
    return [max(column, key=lambda spec: spec.nbytes) for column in zip(*per_variant,
                                                                         strict=True)]


def _grid(grid: Any, kwargs: dict[str, Any]) -> tuple[int, ...]:
    if callable(grid):
        grid = grid(kwargs)
    grid = (grid,) if isinstance(grid, (int, np.integer)) else tuple(grid)
    if not 1 <= len(grid) <= 3 or any(int(g) < 1 for g in grid):
        raise ValueError(f"triton_call: grid must be 1 to 3 positive ints, got {grid}")
    return tuple(int(g) for g in grid)


@every_axis_manual
def triton_call(
    kernel: Any,
    *args: Any,
    out_shape: Any,
    grid: int | Sequence[int] | Callable[[dict[str, Any]], Sequence[int]],
    axis_name: str | Sequence[str],
    axis_index_groups: Sequence[Sequence[int]] | None = None,
    workspace: Sequence[Workspace] | Callable[[dict[str, Any]], Sequence[Workspace]] = (),
    symmetric: Sequence[int] = (),
    num_warps: int | None = None,
    num_stages: int | None = None,
    co_resident: bool = False,
    **kwargs: Any,
) -> Any:
    """Runs a distributed Triton kernel on every device of a ``shard_map`` axis.

    Must be called inside ``jax.shard_map`` (under ``jax.jit`` or not). Each device runs
    the kernel with ``dl.rank()`` = its position along ``axis_name`` and
    ``dl.num_ranks()`` = the axis size; on a mesh with several axes, the devices sharing
    all other coordinates form one team. A tuple of axes makes one team of all their
    devices, ranked row-major in the order named (the first axis varies slowest), as a
    multi-axis ``jax.lax.psum`` does.

    The kernel receives, in order: ``args`` (arrays as pointers, Python scalars as
    values), one pointer per ``out_shape`` entry, one pointer per ``workspace`` entry;
    then ``kwargs`` by name (constexprs and scalars).

    Args:
      kernel: a ``@triton.jit`` function, or one wrapped by
        :func:`jax_triton_dist.autotune.autotune` (each team then runs the config the
        autotuner chooses at the call's first run; ``grid`` and ``workspace`` may be
        functions of the keyword arguments, a config's included).
      *args: per-rank arrays and Python scalars.
      out_shape: a ``jax.ShapeDtypeStruct`` (or a sequence of them): per-rank results.
        Results are ordinary XLA buffers; the kernel must write every element.
      grid: program counts, or a function of ``kwargs`` returning them.
      axis_name: the manual mesh axis (or tuple of axes) that supplies rank and num_ranks.
      axis_index_groups: as in ``jax.lax``: splits the devices along ``axis_name`` into
        groups of equal size (lists of indices along it, covering each once); each group
        is a team, and a device's rank is its position in its group.
      workspace: symmetric scratch buffers (:class:`Workspace`), zeroed once, kept across
        calls; or a function of the keyword arguments returning them.
      symmetric: indices into ``args`` of arrays to stage into the symmetric heap, so that
        peers can read them with ``dl.symm_at``. Staging alternates between two slots by
        epoch, so a rank may run at most one call ahead of a peer that reads its data.
        Kernels read these arrays and never write them (on GPUs a one-rank launch passes
        the array itself: there is no peer to stage for).
      num_warps: warps per program on GPUs (default 4); ignored by the CPU backend.
      num_stages: software-pipelining depth on GPUs (default 3); ignored on CPU.
      co_resident: the kernel's programs wait on each other (a persistent kernel): on GPUs
        the grid must fit on the device at once (checked at the first run: programs times
        the team's ranks on the GPU at most its multiprocessor count); in the CPU
        interpreter every program runs on a thread of its own. An autotune config may
        say the same (``Config(co_resident=True)``).
      **kwargs: constexprs and scalar keyword arguments of the kernel.

    Returns:
      The per-rank result array (or a tuple, if ``out_shape`` is a sequence).

    Raises:
      ValueError: not inside ``shard_map``, unknown axis, bad grid or ``symmetric`` index.
      TypeError: unsupported dtype, argument type, or kernel signature mismatch.

    Example::

        @triton.jit
        def shift_kernel(x_ptr, out_ptr, buf_ptr, n, BLOCK: tl.constexpr):
            ...  # put x into buf on rank+1, notify, wait, copy buf to out

        def step(x):
            return jtd.triton_call(
                shift_kernel, x, x.size, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                workspace=[jtd.Workspace(x.shape, x.dtype)], grid=(1,), axis_name="tp",
                BLOCK=1024)

        jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(x)
    """
    tuner = kernel if isinstance(kernel, tuning.Autotuned) else None
    if tuner is not None:
        kernel = tuner.kernel
    label = _kernel_label(kernel)
    ffi_targets.register()
    settings.check_environment()  # a bad setting fails here, not on a device thread
    debug_settings.check_environment()
    tuning.check_environment()
    bounds.enabled()
    site_uses.drain()  # sites of executables that are gone release their regions
    team_axes = axis_names.team(axis_name, "triton_call", axis_index_groups)
    single = hasattr(out_shape, "shape") and hasattr(out_shape, "dtype")
    outs = [out_shape] if single else list(out_shape)
    outputs = [call_site.ArraySpec(_shape(o.shape, f"{label} result"),
                                   _dtype(o.dtype, f"{label} result")) for o in outs]
    options = {k: int(v) for k, v in (("num_warps", num_warps), ("num_stages", num_stages))
               if v is not None}
    variants = tuning.variants_of(tuner.candidates(kwargs) if tuner else None, kwargs,
                                  options, lambda meta: _grid(grid, meta), bool(co_resident))
    workspaces = _workspaces(workspace, variants, label)

    operands, inputs, params, operand_of = [], [], [], {}
    for position, arg in enumerate(args):
        if isinstance(arg, (bool, int, float, np.integer, np.floating)):
            params.append(("scalar", arg.item() if isinstance(arg, np.generic) else arg))
            continue
        if not hasattr(arg, "shape") or not hasattr(arg, "dtype"):
            raise TypeError(
                f"triton_call: argument {position} of {label} is a {type(arg).__name__}; "
                "expected an array or a Python scalar"
            )
        array = jnp.asarray(arg)
        spec = call_site.ArraySpec(tuple(array.shape), _dtype(array.dtype, f"{label} argument "
                                                               f"{position}"))
        params.append(("array", len(operands)))
        operand_of[position] = len(operands)
        operands.append(array)
        inputs.append(spec)
    staged = set()
    for index in symmetric:
        if index not in operand_of:
            raise ValueError(f"triton_call: symmetric index {index} is not an array argument "
                             f"of {label} (array arguments: {sorted(operand_of)})")
        staged.add(operand_of[index])
    params += [("output", i) for i in range(len(outputs))]
    params += [("workspace", i) for i in range(len(workspaces))]
    for variant in variants:
        _check_signature(kernel, len(params), variant.kwargs, label)

    site = call_site.CallSite(
        kernel=kernel, label=label, variants=variants, team_axes=team_axes,
        params=params, inputs=inputs, symmetric=frozenset(staged), outputs=outputs,
        workspaces=workspaces, tuner=tuner, timeline=timeline_capture.capacity(),
    )
    call_id = call_site.register(site)
    coords = jnp.stack([jax.lax.axis_index(a) for a in team_axes.mesh_axes]).astype(jnp.int32)
    # Results vary over the kernel's axes and every axis an operand varies over; when
    # shard_map checks varying axes, the coordinates vary over all of them.
    checked = jax_compat.varying_axes(coords)
    named = {team_axes.mesh_axes[a] for a in team_axes.axes}
    varying = frozenset().union(named, *map(jax_compat.varying_axes, operands)) & checked
    result_types = jax_compat.result_types([(o.shape, o.dtype) for o in outputs], varying, coords)
    # Not marked as side-effecting: the results are the call's only effect (workspaces are
    # private to the call site), and side-effecting calls make JAX thread a runtime token
    # that re-raises a failed call's error at every later effects barrier.
    call = jax.ffi.ffi_call(TARGET, result_types)
    results = call(coords, *operands, call_id=np.int64(call_id))
    return results[0] if single else tuple(results)
