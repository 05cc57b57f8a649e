"""A timed kernel for the compiled backends: the user's kernel, called between a program-start
and a program-end event (``language/timeline.py``).

Triton reads a kernel's source to compile it, so the wrapper is source text with the kernel's
own parameters (constexprs stay constexprs, defaults stay defaults) registered with
``linecache`` under a name of its own; the kernel itself is inlined into it as any
``@triton.jit`` helper is. Untimed call sites compile the kernel as it is.
"""

from __future__ import annotations

import inspect
import linecache
import threading
from typing import Any

import triton
import triton.language as tl

from jax_triton_dist.language import compiled as _compiled

__all__ = ["timed"]

_lock = threading.Lock()
_wrappers: dict[Any, Any] = {}


def _constexpr_names(fn) -> set[str]:
    names = set()
    for name, param in inspect.signature(fn).parameters.items():
        if param.annotation is tl.constexpr or "constexpr" in str(param.annotation):
            names.add(name)
    return names


def timed(kernel: Any) -> Any:
    """The ``@triton.jit`` kernel that records ``kernel``'s program start and end."""
    with _lock:
        wrapper = _wrappers.get(kernel)
        if wrapper is None:
            wrapper = _wrappers[kernel] = _build(kernel)
        return wrapper


def _build(kernel: Any) -> Any:
    fn = kernel.fn
    constexprs = _constexpr_names(fn)
    params, names, defaults = [], [], {}
    for name, param in inspect.signature(fn).parameters.items():
        text = f"{name}: tl.constexpr" if name in constexprs else name
        if param.default is not inspect.Parameter.empty:
            # Each default is a global of the wrapper's own, a constexpr: Triton evaluates
            # every default of the source it compiles, and reads only constexpr globals
            # (a subscript of a dict of defaults failed: the key arrives as a constexpr).
            defaults[f"_default_{name}"] = tl.constexpr(param.default)
            text += f" = _default_{name}"
        params.append(text)
        names.append(name)
    label = f"{fn.__name__}__jtd_timed"
    source = (f"def {label}({', '.join(params)}):\n"
              f"    _record(0, 0)\n"
              f"    _kernel({', '.join(names)})\n"
              f"    _record(1, 0)\n")
    filename = f"<jax_triton_dist timed {fn.__module__}.{fn.__qualname__}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope = {"tl": tl, "_record": _compiled.record_event, "_kernel": kernel, **defaults}
    exec(compile(source, filename, "exec"), scope)  # noqa: S102 - our own generated text
    return triton.jit(scope[label])
