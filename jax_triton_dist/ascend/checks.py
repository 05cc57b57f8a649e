"""Do the distributed semantics survive the Ascend compiler? Counts, in a kernel's IR, the
operations its source implies (``catalog.Expected``) — flag writes, waits, block barriers
— and fails a lowering that lost any.

The compilers delete code silently (a spin on a non-volatile load, an exchange whose
result is unused, a side-effect-free wait with an unused token), so a kernel that
compiled is not yet a kernel that synchronises. Counts are static: an operation inside
a loop with constant bounds counts once per iteration, inside a branch or a loop with
run-time bounds once; the same rule on the TTIR (before the Ascend compiler) and on the
HIVM IR (after it), so unrolling does not change a count and a deletion lowers it.

Pure text processing: runs and is tested on the CPU machine.
"""

from __future__ import annotations

import dataclasses
import re

from jax_triton_dist.ascend.catalog import Expected
from jax_triton_dist.ascend.mlir_text import Lines, strip

__all__ = ["Counts", "count_ttir", "count_hivm", "check"]

CATEGORIES = ("notifies", "waits", "barriers")


@dataclasses.dataclass
class Counts:
    """Static counts of one IR text."""

    notifies: int = 0
    waits: int = 0
    barriers: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


_CONSTANT = re.compile(r"^\s*(%[\w$.-]+) = arith\.constant (-?\d+) : (?:i\d+|index)\b", re.M)
_FOR = re.compile(r"scf\.for %[\w$.-]+ = (%[\w$.-]+) to (%[\w$.-]+) step (%[\w$.-]+)")


@dataclasses.dataclass
class _Frame:
    trips: int  # iterations of the region's loop (1: not a loop, or run-time bounds)
    kind: str  # "for", "while" or "other"
    lines: list[str] = dataclasses.field(default_factory=list)


def _trips(body: str, constants: dict[str, int]) -> tuple[int, str]:
    found = _FOR.search(body)
    if not found:
        return 1, "while" if "scf.while" in body else "other"
    lb, ub, step = (constants.get(name) for name in found.groups())
    if None in (lb, ub, step) or step <= 0:
        return 1, "for"
    return max(0, -(-(ub - lb) // step)), "for"


def _count(text: str, notify, wait_line, spin_body, barrier) -> Counts:
    """Counts per category; the predicates take ``(lines, index)`` (``spin_body`` a line's
    text: a ``scf.while`` whose body has such a line is a wait)."""
    lines = Lines(text)
    constants = {name: int(value) for name, value in _CONSTANT.findall(text)}
    counts = Counts()
    frames: list[_Frame] = []

    def finish(frame: _Frame) -> None:
        if frame.kind == "while" and any(spin_body(x) for x in frame.lines):
            outer = 1
            for enclosing in frames:
                outer *= enclosing.trips
            counts.waits += outer

    for index, raw in enumerate(lines.lines):
        if raw.startswith("#"):
            continue
        body = strip(raw).strip()
        if re.match(r"\}\s*(do|else)\b.*\{$", body):  # the next region of the same op
            for frame in frames:
                frame.lines.append(raw)
            continue
        for _ in range(lines.closes[index]):
            if frames:
                finish(frames.pop())
        multiplicity = 1
        for frame in frames:
            multiplicity *= frame.trips
            frame.lines.append(raw)
        if notify(lines, index):
            counts.notifies += multiplicity
        if wait_line(raw):
            counts.waits += multiplicity
        if barrier(raw):
            counts.barriers += multiplicity
        if lines.opens[index]:
            frames.append(_Frame(*_trips(body, constants)))
    return counts


_SCALAR_FLAG_STORE = re.compile(r"\btt\.store %[\w$.-]+, %[\w$.-]+ : !tt\.ptr<i(32|64)>")
_SCALAR_FLAG_ADD = re.compile(r"\btt\.atomic_rmw\b.*: \(!tt\.ptr<i(32|64)>")


def count_ttir(text: str, mapping: str) -> Counts:
    """Counts in the TTIR the lowering gave triton-ascend's adapter.

    ``"args"``: a notify is a scalar store (or atomic add) to a 32/64-bit flag, a wait a
    ``scf.while`` around a volatile load. ``"aclshmem"``: their ``jtd_acl_*`` placeholders
    (a notify the lowering kept in the ``"args"`` form counts as in ``"args"``).
    """
    def notify(lines, index):
        line = lines.lines[index]
        return bool(_SCALAR_FLAG_STORE.search(line) or _SCALAR_FLAG_ADD.search(line)
                    or re.search(r'symbol = "jtd_acl_notify_', line))

    return _count(text, notify, lambda line: 'symbol = "jtd_acl_wait_until"' in line,
                  lambda line: "isVolatile = true" in line, lambda line: "gpu.barrier" in line)


# A call of an ACLSHMEM function; in kernels split into cube and vector halves ("mix"),
# each half calls its own copy (".cube", ".vector").
_ACL_CALL = r"\bcall @{symbol}(\.(cube|vector))?\("
_GM_STORE = re.compile(r"\bcall @store_ubuf_to_gm_1d_u?int(32|64)_t\((%[\w$.-]+), (%[\w$.-]+)")
_CAST_OF = r"^\s*{name} = memref\.cast (?P<src>%[\w$.-]+) : (?P<type>memref<[^\n]*?>) to "
_ARGUMENT_VIEW = r"^\s*{name} = memref\.reinterpret_cast %arg\d+ "


def count_hivm(text: str) -> Counts:
    """Counts in the optimised HIVM IR (``module.hivm.opt.mlir``).

    A notify is a store from the unified buffer to one 32/64-bit element of a kernel
    argument in global memory (``store_ubuf_to_gm``; an atomic add is the same store in
    atomic mode; the compiler's own scalar stores go to views of its workspace) or a call of
    ACLSHMEM's put or signal (``aclshmem_int32_p``, ...: the external calls ``hivmc`` links);
    a wait a ``scf.while`` whose body loads from global memory, or a call of
    ``aclshmem_wait_until_*``; a block barrier ``pipe_barrier[<PIPE_ALL>]``.
    """
    def notify(lines, index):
        line = lines.lines[index]
        store = _GM_STORE.search(line)
        if store is not None:
            cast = lines.definition(index, store.group(3), _CAST_OF)
            return (cast is not None and cast.group("type").startswith("memref<1x")
                    and lines.definition(index, cast.group("src"), _ARGUMENT_VIEW) is not None)
        put = _ACL_CALL.format(symbol=r"(aclshmem_int(32|64)_p|aclshmemx_signal_op)")
        return bool(re.search(put, line))

    return _count(text, notify, lambda line: bool(re.search(
                      _ACL_CALL.format(symbol=r"aclshmem_wait_until_\w+?"), line)),
                  lambda line: "load_gm_to_ubuf" in line,
                  lambda line: "hivm.hir.pipe_barrier[<PIPE_ALL>]" in line)


def check(expected: Expected, ttir: Counts, hivm: Counts) -> list[str]:
    """The failures: categories where the TTIR or the HIVM IR counts fewer operations than
    the source implies (empty: the semantics survived)."""
    wanted = {"notifies": expected.notifies, "waits": expected.waits,
              "barriers": expected.barrier_count()}
    failures = []
    for category, need in wanted.items():
        for stage, counts in (("ttir", ttir), ("hivm", hivm)):
            have = getattr(counts, category)
            if have < need:
                failures.append(f"{stage} has {have} {category}, the source implies {need}")
    return failures
