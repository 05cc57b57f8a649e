"""The comparison of a wait, written in Triton (shared by the compiled lowerings)."""

import triton
import triton.language as tl

__all__ = ["fails"]


@triton.jit
def fails(seen, value, CMP: tl.constexpr):
    """Whether ``seen CMP value`` does not hold yet (``CMP``: a name of ``dl.CMPS``)."""
    if CMP == "eq":  # noqa: SIM116 - a Triton function: no dicts of tensors
        return seen != value
    elif CMP == "ne":
        return seen == value
    elif CMP == "gt":
        return seen <= value
    elif CMP == "ge":
        return seen < value
    elif CMP == "lt":
        return seen >= value
    else:
        return seen > value
