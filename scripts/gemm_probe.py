"""GPU machine: the bf16 GEMM tile launched by Triton's own launcher (PyTorch tensors) vs
compiled by ``runtime/cuda_compile.py``: speed of the former, and what differs between the
two compiled kernels (shared memory, cp.async, wgmma). Diagnoses launch-path regressions.

    python3 scripts/gemm_probe.py
"""

import jax.numpy as jnp
import numpy as np
import torch
import triton

from jax_triton_dist.kernels.gemm import matmul_kernel
from jax_triton_dist.runtime import cuda_compile

M = N = K = 8192
CONFIG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}


def main() -> None:
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    grid = (triton.cdiv(M, 128) * triton.cdiv(N, 256),)

    def launch():
        return matmul_kernel[grid](a, b, c, M, N, K, K, 1, N, 1, N, 1, **CONFIG, num_warps=8,
                                   num_stages=3)

    ms = triton.testing.do_bench(launch)
    print(f"Triton's launcher: {ms:.3f} ms, {2 * M * N * K / ms / 1e9:.0f} TFLOP/s")
    jit = list(matmul_kernel.device_caches[0][0].values())[0]

    positional = [("pointer", np.dtype(jnp.bfloat16))] * 3
    kwargs = {"M": M, "N": N, "K": K, "stride_am": K, "stride_ak": 1, "stride_bk": N,
              "stride_bn": 1, "stride_cm": N, "stride_cn": 1, **CONFIG}
    signature, constexprs = cuda_compile.signature_of(matmul_kernel, positional, kwargs)
    ours = cuda_compile.compile_kernel(
        matmul_kernel, signature, constexprs, num_warps=8, num_stages=3,
        attrs=cuda_compile.divisibility(signature, positional, kwargs))
    print("our signature:", signature)
    for name, kernel in (("Triton JIT", jit), ("cuda_compile", ours)):
        ptx = kernel.asm["ptx"]
        print(f"{name}: shared {kernel.metadata.shared}, wgmma {ptx.count('wgmma.mma_async')}, "
              f"cp.async {ptx.count('cp.async')}, ld.global {ptx.count('ld.global')}")


if __name__ == "__main__":
    main()
