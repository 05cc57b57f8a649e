"""GEMM epilogues: a bias added to each output column and an activation, applied to a
float32 tile before it is stored (``ACTIVATION``: ``"none"``, ``"relu"``, ``"silu"``,
``"gelu_tanh"``, ``"gelu"``; written with ``sigmoid``/``erf`` so that every backend, the
interpreter included, has them)."""

import triton
import triton.language as tl

ACTIVATIONS = ("none", "relu", "silu", "gelu_tanh", "gelu")


@triton.jit
def apply_epilogue(acc, bias_ptr, pid_n, N, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                   ACTIVATION: tl.constexpr):
    """``activation(acc + bias[columns of tile pid_n])`` (float32)."""
    if HAS_BIAS:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == "silu":
        acc = acc * tl.sigmoid(acc)
    elif ACTIVATION == "gelu_tanh":  # tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * u)
    elif ACTIVATION == "gelu":
        acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    return acc
