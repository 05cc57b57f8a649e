"""Thread-safe launches of Triton kernels in Triton's interpreter.

The CPU backend runs one rank per JAX CPU device, each on XLA's thread for that
device, so several kernels run in the interpreter at once and wait on each
other's flags. Triton 3.6's interpreter is not built for that:

* the program id lives on one global ``InterpreterBuilder``; here it becomes
  thread-local;
* ``GridExecutor`` patches ``triton.language`` for each launch and restores it
  afterwards, which breaks kernels still running on other threads; here the
  patch is taken when the first kernel starts and restored when the last one
  ends (a reference count);
* scalar tensors convert to ``int`` in a way NumPy >= 2.4 rejects, and ``tl.dot``
  multiplies bfloat16 operands as raw bit patterns; both fixed here;
* nested ``@triton.jit`` helpers must be ``InterpretedFunction`` objects, which
  they are only if ``TRITON_INTERPRET=1`` was set before they were defined;
  here a ``JITFunction`` called from an interpreted kernel runs interpreted;
* loads, stores and atomics check their addresses against the launch's buffers
  (``bounds.py``) when the launching thread set some.

Kernels are ordinary ``@triton.jit`` functions; the environment is not touched.
A launch runs its programs one after another, so no program may wait for another
program of the same launch — unless the launch is ``concurrent`` (a persistent kernel
whose programs are all resident at once on a GPU): its programs then run on a thread
each.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import triton.language as tl
import triton.language.core as tl_core  # patched with tl: helpers such as tl.zeros call core.full
from triton.runtime import interpreter as _interp
from triton.runtime.jit import JITFunction

from jax_triton_dist.language import bounds, timeline
from jax_triton_dist.runtime import python_ast

__all__ = ["Pointer", "launch", "interpreting"]


class Pointer:
    """A raw host address with a dtype: what the interpreter takes for a tensor argument."""

    def __init__(self, address: int, dtype: np.dtype | str):
        self.address = int(address)
        self.dtype = np.dtype(dtype).name if not isinstance(dtype, str) else dtype

    def data_ptr(self) -> int:
        return self.address

    def __repr__(self) -> str:
        return f"Pointer(0x{self.address:x}, {self.dtype})"


# ---------------------------------------------------------------------------
# Patch scope shared by all running kernels
# ---------------------------------------------------------------------------

_lock = threading.Lock()
_active = 0
_scope: Any = None
_grid = threading.local()
_rewritten: dict[Callable, Callable] = {}


def _grid_idx_get(self):
    return getattr(_grid, "idx", None)


def _grid_idx_set(self, value):
    _grid.idx = value


def _grid_dim_get(self):
    return getattr(_grid, "dim", None)


def _grid_dim_set(self, value):
    _grid.dim = value


def _rewrite(fn: Callable) -> Callable:
    rewritten = _rewritten.get(fn)
    if rewritten is None:
        # CPython's AST module is not thread-safe: one parse at a time (python_ast.py).
        with python_ast.LOCK:
            rewritten = _rewritten.get(fn)
            if rewritten is None:
                rewritten = _interp.FunctionRewriter(fn).rewrite_ast()
                _rewritten[fn] = rewritten
    return rewritten


def _nested_call(self, *args, **kwargs):
    """``__call__`` of jitted functions while kernels run: a helper called from a kernel."""
    if not interpreting():
        raise RuntimeError(
            f"@triton.jit function {self.fn.__name__} cannot be called outside a kernel"
        )
    return _rewrite(self.fn)(*args, **kwargs)


def _tensor_index(self) -> int:
    return int(np.asarray(self.handle.data).reshape(-1)[0])


_original_create_dot = _interp.InterpreterBuilder.create_dot


def _bf16_as_f32(handle):
    if handle.dtype != tl.bfloat16:
        return handle
    data = (np.asarray(handle.data).astype(np.uint32) << 16).view(np.float32)
    return _interp.TensorHandle(data, tl.float32)


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _original_create_dot(self, _bf16_as_f32(a), _bf16_as_f32(b), d, input_precision,
                                max_num_imprecise_acc)


_ORIGINAL = {name: getattr(_interp.InterpreterBuilder, name) for name in (
    "create_masked_load", "create_masked_store", "create_atomic_cas", "create_atomic_rmw")}


def _check(ptrs, mask, op: str) -> None:
    element = ptrs.get_element_ty()
    bounds.check(ptrs.data, None if mask is None else mask.data,
                 max(1, element.primitive_bitwidth // 8), op, str(element))


def _checked_load(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile):
    _check(ptrs, mask, "load")
    return _ORIGINAL["create_masked_load"](self, ptrs, mask, other, cache_modifier,
                                           eviction_policy, is_volatile)


def _checked_store(self, ptrs, value, mask, cache_modifier, eviction_policy):
    _check(ptrs, mask, "store")
    return _ORIGINAL["create_masked_store"](self, ptrs, value, mask, cache_modifier,
                                            eviction_policy)


def _checked_cas(self, ptr, cmp, val, sem, scope):
    _check(ptr, None, "atomic_cas")
    return _ORIGINAL["create_atomic_cas"](self, ptr, cmp, val, sem, scope)


def _checked_rmw(self, rmw_op, ptr, val, mask, sem, scope):
    _check(ptr, mask, "atomic")
    return _ORIGINAL["create_atomic_rmw"](self, rmw_op, ptr, val, mask, sem, scope)


def _anchor() -> None:  # a function whose globals hold triton.language and its core
    return tl, tl_core


def _enter() -> None:
    global _active, _scope
    with _lock:
        if _active == 0:
            scope = _interp._patch_lang(_anchor)
            scope.set_attr(_interp.InterpreterBuilder, "grid_idx",
                           property(_grid_idx_get, _grid_idx_set))
            scope.set_attr(_interp.InterpreterBuilder, "grid_dim",
                           property(_grid_dim_get, _grid_dim_set))
            # Triton 3.6 converts scalars with int() of a 1-element array, which NumPy 2.4
            # rejects.
            scope.set_attr(tl.tensor, "__index__", _tensor_index)
            # Triton 3.6 multiplies bfloat16 dot operands as raw uint16 bit patterns.
            scope.set_attr(_interp.InterpreterBuilder, "create_dot", _create_dot)
            scope.set_attr(JITFunction, "__call__", _nested_call)
            scope.set_attr(_interp.InterpretedFunction, "__call__", _nested_call)
            for name, checked in (("create_masked_load", _checked_load),
                                  ("create_masked_store", _checked_store),
                                  ("create_atomic_cas", _checked_cas),
                                  ("create_atomic_rmw", _checked_rmw)):
                scope.set_attr(_interp.InterpreterBuilder, name, checked)
            _scope = scope
        _active += 1


def _exit() -> None:
    global _active, _scope
    with _lock:
        _active -= 1
        if _active == 0:
            _scope.restore()
            _scope = None


def interpreting() -> bool:
    """Whether the calling thread is running a kernel in the interpreter."""
    return getattr(_grid, "running", False)


# ---------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------


def _python_fn(kernel) -> Callable:
    fn = getattr(kernel, "fn", None)
    if fn is None or not callable(fn):
        raise TypeError(f"expected a @triton.jit kernel, got {type(kernel).__name__}")
    return fn


def constexpr_names(fn: Callable) -> set[str]:
    """Parameters of ``fn`` annotated ``tl.constexpr``."""
    names = set()
    for name, param in inspect.signature(fn).parameters.items():
        annotation = param.annotation
        if annotation is tl.constexpr or "constexpr" in str(annotation):
            names.add(name)
    return names


def launch(kernel, grid: Sequence[int], args: Sequence[Any], kwargs: dict[str, Any],
           concurrent: bool = False,
           program_scope: Callable[[], contextlib.AbstractContextManager] | None = None,
           on_failure: Callable[[BaseException], None] | None = None) -> None:
    """Runs ``kernel[grid](*args, **kwargs)`` in the interpreter on the calling thread.

    Args:
      kernel: a ``@triton.jit`` function (compiled or interpreted flavour).
      grid: up to three program counts.
      args: positional kernel arguments: :class:`Pointer`, Python scalars.
      kwargs: keyword arguments (constexprs and scalars).
      concurrent: run every program on a thread of its own, so that programs may wait on
        each other (their thread-local state comes from ``program_scope``).
      program_scope: entered on each program's thread of a concurrent launch (the rank's
        PE binding, rank context and address checks).
      on_failure: called on the failing program's thread as soon as a program of a
        concurrent launch fails (so that the rank's other programs stop waiting).
    """
    fn = _python_fn(kernel)
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    constexprs = constexpr_names(fn)
    call_args = {
        name: value if name in constexprs else _interp._implicit_cvt(value)
        for name, value in bound.arguments.items()
    }
    programs = list(itertools.product(range(grid[0]), range(grid[1]), range(grid[2])))
    _enter()
    try:
        rewritten = _rewrite(fn)
        if not concurrent:
            _run_programs(rewritten, grid, programs, call_args)
            return
        errors: list[BaseException] = []

        def program(index: tuple[int, int, int]) -> None:
            try:
                with program_scope() if program_scope else contextlib.nullcontext():
                    _run_programs(rewritten, grid, [index], call_args)
            except BaseException as error:  # noqa: BLE001 - raised on the launching thread
                errors.append(error)
                if on_failure is not None:
                    on_failure(error)

        threads = [threading.Thread(target=program, args=(index,), daemon=True)
                   for index in programs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
    finally:
        _exit()


def _run_programs(rewritten: Callable, grid: tuple[int, int, int],
                  programs: Sequence[tuple[int, int, int]], call_args: dict[str, Any]) -> None:
    """Runs ``programs`` (grid indices) of a launch one after another on this thread."""
    builder = _interp.interpreter_builder
    _grid.running = True
    try:
        builder.set_grid_dim(*grid)
        for x, y, z in programs:
            builder.set_grid_idx(x, y, z)
            timeline.record_interpreted(timeline.Kind.PROGRAM_START)
            rewritten(**call_args)
            timeline.record_interpreted(timeline.Kind.PROGRAM_END)
    finally:
        _grid.running = False
