"""The ``"aclshmem"`` mapping's second half: ``jtd_acl_*`` placeholders in the ttadapter
(linalg) module become ``hivm.hir.custom "dist.aclshmem_*"`` calls, the form AscendNPU IR
lowers to external calls that ``hivmc`` links against ACLSHMEM's device library.

The placeholders carry addresses as integers (extern calls with pointer operands fail in
the adapter); the adapter writes each such integer as ``arith.index_cast`` of
``memref.extract_aligned_pointer_as_index`` of a one-element memref view of the flag, and
that memref (with its offset) is what the ACLSHMEM call takes. A placeholder whose
address cannot be traced so raises :class:`RewriteError` naming its primitive; the
lowering then keeps that primitive in the ``"args"`` form.

Pure text processing (no triton-ascend needed): tested on the CPU machine.
"""

from __future__ import annotations

import re

from jax_triton_dist.ascend.mlir_text import Lines

__all__ = ["RewriteError", "rewrite", "PRIMITIVE_OF"]

PRIMITIVE_OF = {
    "team_my_pe": "rank", "team_n_pes": "num_ranks", "ptr_delta": "symm_at",
    "notify_set": "notify", "notify_add": "notify", "wait_until": "wait", "fence": "fence",
}
"""The ``dl`` primitive each placeholder lowers."""


class RewriteError(ValueError):
    """A placeholder that cannot become an ACLSHMEM call; ``primitive`` names its ``dl``
    primitive."""

    def __init__(self, primitive: str, message: str):
        super().__init__(message)
        self.primitive = primitive


_PLACEHOLDER = re.compile(
    r'^(?P<indent>[ \t]*)(?P<result>%[\w$.-]+) = tt\.extern_elementwise\s*(?P<operands>[^{\n]*?)'
    r'\s*\{[^}\n]*symbol = "jtd_acl_(?P<call>\w+)"[^}\n]*\}\s*:\s*\((?P<types>[^)]*)\)\s*->\s*'
    r'(?P<ret>[^\s]+)')
_ADDRESS = r'^[ \t]*{name} = arith\.index_cast (?P<src>%[\w$.-]+) : index to i64'
_ALIGNED = (r'^[ \t]*{name} = memref\.extract_aligned_pointer_as_index (?P<memref>%[\w$.-]+)'
            r' : (?P<type>memref<[^\n]*?>) -> index')


def _attributes(text: str, extra: str = "", pure: bool = False) -> str:
    """The attributes of an ACLSHMEM call: ``pure`` (``no_side_effect``) only on queries."""
    # Kernels with matrix work run on cube and vector cores ("mix"); others on vector ones.
    core = "CUBE_AND_VECTOR" if "linalg.matmul" in text else "VECTOR"
    attrs = ["hivm.is_distributed"] + (["no_side_effect"] if pure else []) + [
        "hivm.pipe = #hivm.pipe<PIPE_S>", f"hivm.tcore_type = #hivm.tcore_type<{core}>",
        "hivm.vf_mode = #hivm.vf_mode<SIMD>"]
    if extra:
        attrs.append(extra)
    return ", ".join(attrs)


def _memref_of(lines: Lines, index: int, address: str,
               primitive: str) -> tuple[str, str, str, list[str]]:
    """``(memref, its type, aligned-pointer index, lines to emit first)`` behind the i64
    ``address`` used at line ``index``. The address of a whole argument (a kernel
    parameter's own pointer) gets a one-element view of it."""
    cast = lines.definition(index, address, _ADDRESS)
    if cast is None:
        raise RewriteError(primitive, f"the address {address} is not an index_cast of a "
                                      "memref's aligned pointer")
    aligned = lines.definition(index, cast.group("src"), _ALIGNED)
    if aligned is None:
        raise RewriteError(primitive, f"the address {address} does not come from "
                                      "memref.extract_aligned_pointer_as_index")
    memref, memref_type = aligned.group("memref"), aligned.group("type")
    if memref_type.startswith("memref<1x"):
        return memref, memref_type, cast.group("src"), []
    whole = re.fullmatch(r"memref<\?x(\w+)>", memref_type)
    if whole is None:
        raise RewriteError(primitive, f"the flag view {memref_type} is not one element")
    view = f"%jtd_view{index}"
    view_type = f"memref<1x{whole.group(1)}, strided<[1]>>"
    prelude = [f"{view} = memref.reinterpret_cast {memref} to offset: [0], sizes: [1], "
               f"strides: [1] : {memref_type} to {view_type}"]
    return view, view_type, cast.group("src"), prelude


_ACLSHMEM_TYPE = {"i32": "int32", "i64": "int64"}


def _element(memref_type: str, primitive: str) -> str:
    """ACLSHMEM's name of the element type of a one-element memref."""
    element = re.match(r"memref<1x(\w+)", memref_type).group(1)
    if element not in _ACLSHMEM_TYPE:
        raise RewriteError(primitive, f"no ACLSHMEM call takes {element} flags")
    return _ACLSHMEM_TYPE[element]


def _custom(symbol: str, attrs: str, operands: list[str], types: list[str],
            result: str = "") -> str:
    ins = f" ins({', '.join(operands)} : {', '.join(types)})" if operands else ""
    out = f" -> {result}" if result else ""
    return f'hivm.hir.custom {{{attrs}, symbol = "{symbol}"}} "dist.{symbol}"{ins}{out}'


def _replacement(text: str, lines: Lines, index: int, match: re.Match,
                 side_effect_free_waits: bool) -> str:
    call, result, indent = match.group("call"), match.group("result"), match.group("indent")
    operands = [o.strip() for o in match.group("operands").split(",") if o.strip()]
    types = [t.strip() for t in match.group("types").split(",") if t.strip()]
    primitive = PRIMITIVE_OF.get(call)
    if primitive is None:
        raise RewriteError(call, f"unknown ACLSHMEM placeholder jtd_acl_{call}")
    emitted = []
    if call in ("team_my_pe", "team_n_pes"):
        symbol = f"aclshmem_{call}"
        emitted.append(f"{result} = " + _custom(symbol, _attributes(text, pure=True), operands,
                                               types, "i32"))
    elif call == "ptr_delta":
        memref, memref_type, local, emitted = _memref_of(lines, index, operands[0], primitive)
        element = _element(memref_type, primitive)
        name = result.lstrip("%")
        emitted += [
            f"%jtd_{name}_peer = " + _custom(f"aclshmem_ptr_{element}",
                                         _attributes(text, pure=True), [memref, operands[1]],
                                         [memref_type, "i32"], memref_type),
            f"%jtd_{name}_addr = memref.extract_aligned_pointer_as_index %jtd_{name}_peer : "
            f"{memref_type} -> index",
            f"%jtd_{name}_delta = arith.subi %jtd_{name}_addr, {local} : index",
            f"{result} = arith.index_cast %jtd_{name}_delta : index to i64"]
    elif call in ("notify_set", "notify_add", "wait_until"):
        memref, memref_type, _, emitted = _memref_of(lines, index, operands[0], primitive)
        element = _element(memref_type, primitive)
        bits = element.removeprefix("int")
        if call == "notify_set":
            symbol = f"aclshmem_{element}_p"
            extra = "commScope = 2 : i32, sigOp = 0 : i32"
            ins, ins_types = [memref, operands[1], operands[2]], [memref_type, types[1], "i32"]
        elif call == "notify_add":
            if bits != "32":
                raise RewriteError(primitive, "aclshmemx_signal_op takes 32-bit signals only")
            symbol, extra = "aclshmemx_signal_op", ""
            name = result.lstrip("%")
            emitted.append(f"%jtd_{name}_op = arith.constant 1 : i32")
            ins = [memref, operands[1], f"%jtd_{name}_op", operands[2]]
            ins_types = [memref_type, "i32", "i32", "i32"]
        else:
            symbol, extra = f"aclshmem_wait_until_{element}", ""
            ins, ins_types = [memref, operands[1], operands[2]], [memref_type, "i32", types[2]]
        pure = call == "wait_until" and side_effect_free_waits
        emitted.append(_custom(symbol, _attributes(text, extra, pure), ins, ins_types))
        emitted.append(f"{result} = arith.constant 0 : i32")
    else:  # fence
        emitted.append(_custom("aclshmem_fence", _attributes(text), [], []))
        emitted.append(f"{result} = arith.constant 0 : i32")
    return "\n".join(indent + line for line in emitted)


def rewrite(text: str, side_effect_free_waits: bool = False) -> str:
    """``text`` (a ttadapter module) with every ``jtd_acl_*`` placeholder replaced.

    ``side_effect_free_waits`` marks the wait calls ``no_side_effect`` — wrong (the
    compiler may delete them): only for the check's negative control.

    Raises:
      RewriteError: a placeholder cannot be formed into its ACLSHMEM call.
    """
    lines = Lines(text)
    out = []
    for index, line in enumerate(lines.lines):
        match = _PLACEHOLDER.match(line)
        out.append(_replacement(text, lines, index, match, side_effect_free_waits) if match
                   else line)
    return "\n".join(out) + "\n"
