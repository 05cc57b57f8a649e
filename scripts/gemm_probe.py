import torch, triton, numpy as np, jax.numpy as jnp
from jax_triton_dist.kernels.gemm import matmul_kernel
from jax_triton_dist.runtime import cuda_compile
M=N=K=8192
a=torch.randn(M,K,device='cuda',dtype=torch.bfloat16); b=torch.randn(K,N,device='cuda',dtype=torch.bfloat16); c=torch.empty(M,N,device='cuda',dtype=torch.bfloat16)
grid=(triton.cdiv(M,128)*triton.cdiv(N,256),)
f=lambda: matmul_kernel[grid](a,b,c,M,N,K,K,1,N,1,N,1,BLOCK_M=128,BLOCK_N=256,BLOCK_K=64,GROUP_M=8,num_warps=8,num_stages=3)
ms=triton.testing.do_bench(f)
print("triton launcher: %.3f ms  %.0f TF/s"%(ms, 2*M*N*K/ms/1e9))
k=list(matmul_kernel.device_caches[0][0].values())[0]
print("triton jit:", k.metadata.shared, k.metadata.num_warps, k.n_regs, k.n_spills, k.src.signature if hasattr(k,'src') else '', )
pos=[("pointer", np.dtype(jnp.bfloat16))]*3
kw=dict(M=M,N=N,K=K,stride_am=K,stride_ak=1,stride_bk=N,stride_bn=1,stride_cm=N,stride_cn=1,BLOCK_M=128,BLOCK_N=256,BLOCK_K=64,GROUP_M=8)
sig,cx=cuda_compile.signature_of(matmul_kernel,pos,kw); attrs=cuda_compile.divisibility(sig,pos,kw)
print(sig, cx, attrs)
ours=cuda_compile.compile_kernel(matmul_kernel,sig,cx,attrs=attrs,num_warps=8,num_stages=3)
print("ours:", ours.metadata.shared, ours.metadata.num_warps)
print("ptx lens", len(k.asm["ptx"]), len(ours.asm["ptx"]))
for name,kk in [("jit",k),("ours",ours)]:
    p=kk.asm["ptx"]; print(name, "wgmma", p.count("wgmma.mma_async"), "cp.async", p.count("cp.async"), "tensormap", p.count("tensormap"), "ld.global", p.count("ld.global"))
