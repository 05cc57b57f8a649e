"""Lowers a kernel with triton-ascend to HIVM IR: ``ttir`` -> ``ttadapter`` (linalg + hivm)
-> ``bishengir-compile`` -> ``module.hivm.opt.mlir``. Runs where triton-ascend is
installed (``python -m jax_triton_dist.ascend`` starts it there).

Between the stages the distributed primitives' placeholders (``language/ascend.py``) are
rewritten: after ``make_ttir``, the context placeholders become trailing kernel arguments
(``device_abi.ASCEND_TRAILING_ARGS``); after ``ttir_to_linalg`` (``"aclshmem"`` mapping),
the ``jtd_acl_*`` calls become ``hivm.hir.custom "dist.aclshmem_*"`` ops on the memref of
the address they were given. The binary step (``hivmc``, part of CANN) is not available
here: ``bishengir-compile --save-temps`` leaves the optimised HIVM IR it would take.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from typing import Any

from jax_triton_dist.ascend import aclshmem_calls
from jax_triton_dist.ascend.mlir_text import Lines
from jax_triton_dist.language import ascend as ascend_lowering
from jax_triton_dist.language.device_abi import ASCEND_TRAILING_ARGS

__all__ = ["DEFAULT_ARCH", "BISHENGIR_FLAGS", "Lowered", "bishengir_path", "lower",
           "trailing_arguments"]

DEFAULT_ARCH = "Ascend910B3"
BISHENGIR_FLAGS = ("--enable-auto-multi-buffer=True", "--enable-auto-bind-sub-block=True",
                   "--enable-hfusion-compile=true", "--enable-hivm-compile=true",
                   "--enable-triton-kernel-compile=true")
"""bishengir-compile's flags for a Triton kernel (as triton-ascend's backend passes them for
Ascend 910B), after ``--target``."""

_MISSING_HIVMC = "Cannot find hivmc"


@dataclasses.dataclass
class Lowered:
    """What one lowering produced (texts are None past the stage that failed)."""

    ttir: str | None = None
    ttadapter: str | None = None
    hivm: str | None = None
    command: list[str] = dataclasses.field(default_factory=list)
    stage: str = "none"  # the last stage reached: "ttir", "ttadapter" or "hivm"
    error: str = ""
    forms: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)  # e.g. a tool crash retried


def bishengir_path() -> str:
    """The ``bishengir-compile`` of the ``ascendnpu-ir`` wheel (or on ``$PATH``).

    Raises:
      FileNotFoundError: neither is there.
    """
    try:
        import ascendnpuir
    except ImportError:
        ascendnpuir = None
    if ascendnpuir is not None:
        path = os.path.join(os.path.dirname(ascendnpuir.__file__), "bin", "bishengir-compile")
        if os.path.exists(path):
            return path
    found = shutil.which("bishengir-compile")
    if found is None:
        raise FileNotFoundError("bishengir-compile not found: pip install ascendnpu-ir==1.2.0")
    return found


# ---------------------------------------------------------------------------
# TTIR: context placeholders -> trailing kernel arguments
# ---------------------------------------------------------------------------

_FUNC = re.compile(r"(tt\.func public @[\w$.]+\()(.*?)(\) attributes)", re.S)
_CONTEXT_PLACEHOLDER = re.compile(
    r'^[ \t]*(%[\w$.-]+) = tt\.extern_elementwise\s*\{[^}\n]*symbol = "jtd_(?!acl_)(\w+)"'
    r'[^}\n]*\} : \(\) -> ')


def _rename(line: str, old: str, new: str) -> str:
    return re.sub(re.escape(old) + r"(?![\w$.-])", new, line)


def trailing_arguments(ttir: str) -> str:
    """``ttir`` with the context placeholders replaced by trailing kernel arguments (each
    use renamed within the placeholder's region: MLIR reuses names in sibling regions).

    Raises:
      ValueError: no kernel function, or a placeholder of an unknown argument.
    """
    names = {name for name, _ in ASCEND_TRAILING_ARGS}
    found = _FUNC.search(ttir)
    if found is None:
        raise ValueError("no `tt.func public` kernel in the TTIR")
    extra = "".join(f", %jtd_{name}: {ty}" for name, ty in ASCEND_TRAILING_ARGS)
    lines = Lines(ttir[:found.end(2)] + extra + ttir[found.end(2):])
    out, renames = [], []  # renames: (old, new, depth of the defining region)
    for line, depth in zip(lines.lines, lines.depth, strict=True):
        renames = [r for r in renames if depth >= r[2]]
        match = _CONTEXT_PLACEHOLDER.match(line)
        if match:
            if match.group(2) not in names:
                raise ValueError(f"unknown context placeholder jtd_{match.group(2)}")
            renames.append((match.group(1), f"%jtd_{match.group(2)}", depth))
            continue
        for old, new, _ in renames:
            line = _rename(line, old, new)
        out.append(line)
    return "\n".join(out) + "\n"


class _Text:
    """What ``ttir_to_linalg`` takes: anything whose ``str`` is the module."""

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text


# ---------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------


def _frontend(kernel, signature: dict[str, str], constants: dict[str, Any], arch: str):
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend

    target = GPUTarget("npu", arch, 0)
    backend = make_backend(target)
    options = backend.parse_options({})
    source = ASTSource(kernel, signature, constants=constants)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(options, backend.get_codegen_implementation(),
                            backend.get_module_map(), context)
    stages: dict[str, Any] = {}
    backend.add_stages(stages, options)
    metadata = {"hash": f"jtd-{kernel.fn.__name__}", "target": target, **options.__dict__}
    return module, stages, metadata


def _run_bishengir(ttadapter: str, arch: str, out_dir: str) -> tuple[list[str], str | None, str]:
    """Runs bishengir-compile; returns the command, the HIVM text (or None) and stderr."""
    path = os.path.join(out_dir, "ttadapter.mlir")
    temps = os.path.join(out_dir, "bishengir-temps")
    os.makedirs(temps, exist_ok=True)
    command = [bishengir_path(), path, f"--target={arch}", *BISHENGIR_FLAGS,
               f"--save-temps={temps}", "-o", os.path.join(temps, "kernel")]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    hivm_path = os.path.join(temps, "module.hivm.opt.mlir")
    hivm = None
    if os.path.exists(hivm_path):
        with open(hivm_path) as f:
            hivm = f.read()
    return command, hivm, done.stderr + done.stdout


# triton-ascend 3.2's triton-adapter-opt was seen to crash (an LLVM stack dump) once on a
# TTIR it lowered on every later attempt (matmul_reduce_scatter_persistent, 8 ranks, CI of
# 2026-12-06): a crash of the tool, not a compile error, is retried; each retry is noted.
TOOL_CRASH_ATTEMPTS = 3


def tool_crashed(error: BaseException) -> bool:
    """Whether a stage's ``CalledProcessError`` is the tool crashing (killed by a signal or
    an LLVM stack dump) rather than rejecting its input."""
    stderr = getattr(error, "stderr", None) or ""
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    return getattr(error, "returncode", 0) < 0 or "Stack dump" in stderr or (
        "PLEASE submit a bug report" in stderr)


def retry_tool_crashes(stage, what: str, notes: list[str]):
    """``stage()``, run again (up to :data:`TOOL_CRASH_ATTEMPTS` in all) while it fails by
    :func:`tool_crashed`; each crash is appended to ``notes``. Other errors, and the last
    crash, are raised."""
    attempt = 1
    while True:
        try:
            return stage()
        except Exception as error:  # noqa: BLE001 - only tool crashes are retried
            if attempt == TOOL_CRASH_ATTEMPTS or not tool_crashed(error):
                raise
            notes.append(f"{what} crashed on attempt {attempt} "
                         f"({type(error).__name__}, return code "
                         f"{getattr(error, 'returncode', '?')}); retried on the same input")
            attempt += 1


def _write(out_dir: str, name: str, text: str) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(text)


def _stage_error(error: BaseException) -> str:
    stderr = getattr(error, "stderr", None)
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    return f"{type(error).__name__}: {stderr.strip()[-2000:] if stderr else error}"


def lower(kernel, signature: dict[str, str], constants: dict[str, Any], *, ranks: int,
          mapping: str, out_dir: str, arch: str = DEFAULT_ARCH,
          force_args: frozenset[str] = frozenset(),
          side_effect_free_waits: bool = False) -> Lowered:
    """Lowers one kernel into ``out_dir`` (``ttir.mlir``, ``ttadapter.mlir``,
    ``hivm.mlir``, ``command.txt``); errors end the lowering and are returned, not raised.

    ``force_args``: primitives lowered in the ``"args"`` form even under ``"aclshmem"``
    (set by :func:`lower` itself when an ACLSHMEM call cannot be formed).
    ``side_effect_free_waits``: the negative control's wrong wait form (``controls``).
    """
    os.makedirs(out_dir, exist_ok=True)
    result = Lowered()
    try:
        with ascend_lowering.compiling(mapping=mapping, num_ranks=ranks,
                                       force_args=force_args) as state:
            module, stages, metadata = _frontend(kernel, signature, constants, arch)
            ttir = trailing_arguments(str(stages["ttir"](module, metadata)))
            result.forms = state.forms
    except Exception as error:  # noqa: BLE001 - reported per kernel
        result.error = f"ttir: {_stage_error(error)}"
        return result
    result.ttir, result.stage = ttir, "ttir"
    _write(out_dir, "ttir.mlir", ttir)
    try:
        linalg = retry_tool_crashes(lambda: stages["ttadapter"](_Text(ttir), metadata),
                                    "triton-adapter-opt", result.notes)
    except Exception as error:  # noqa: BLE001
        result.error = f"ttadapter: {_stage_error(error)}"
        return result
    linalg = re.sub(r',\s*mix_mode\s*=\s*"[^"]*"', "", linalg)
    if mapping == "aclshmem":
        try:
            linalg = aclshmem_calls.rewrite(linalg, side_effect_free_waits)
        except aclshmem_calls.RewriteError as error:
            if error.primitive in force_args:
                result.error = f"ttadapter: {error}"
                return result
            retry = lower(kernel, signature, constants, ranks=ranks, mapping=mapping,
                          out_dir=out_dir, arch=arch, force_args=force_args | {error.primitive},
                          side_effect_free_waits=side_effect_free_waits)
            for form in retry.forms.get(error.primitive, {}):
                retry.forms[error.primitive][form] += f" ({error})"
            retry.notes[:0] = result.notes
            return retry
    result.ttadapter, result.stage = linalg, "ttadapter"
    _write(out_dir, "ttadapter.mlir", linalg)
    result.command, hivm, log = _run_bishengir(linalg, arch, out_dir)
    _write(out_dir, "command.txt", " ".join(result.command) + "\n")
    if hivm is None:
        result.error = f"bishengir-compile: {log.strip()[-2000:]}"
        return result
    result.hivm, result.stage = hivm, "hivm"
    _write(out_dir, "hivm.mlir", hivm)
    if _MISSING_HIVMC not in log:
        result.error = f"bishengir-compile did not stop at hivmc: {log.strip()[-500:]}"
    return result
