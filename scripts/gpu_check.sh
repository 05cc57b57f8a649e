#!/usr/bin/env bash
# One command for the GPU machine (device tool): build the project with the machine's own
# packages, run the GPU tier and the compile tests, run the GPU benchmarks; logs and JSON
# go to $OUT (or ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export JTD_WAIT_TIMEOUT=${JTD_WAIT_TIMEOUT:-20}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"
} 2>&1 | tee "$OUT/machine.txt"

echo "== build" | tee "$OUT/build.log"
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -q . >>"$OUT/build.log" 2>&1 || {
  tail -50 "$OUT/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log"

# Run from outside the source tree so the installed package (with its extensions) is used.
cd "$OUT"
echo "== GPU tier"
python3 -m pytest -q -p no:cacheprovider "$OLDPWD/tests/test_gpu.py" \
  "$OLDPWD/tests/test_one_gpu.py" "$OLDPWD/tests/test_cuda_compile.py" 2>&1 | tee "$OUT/tests.log" | tail -30
tests_rc=${PIPESTATUS[0]}

echo "== demo: TP MLP on the GPU(s)"
python3 "$OLDPWD/examples/tp_mlp.py" 2>&1 | tee "$OUT/tp_mlp.log" | tail -4

echo "== SASS of the bf16 GEMM tile (expect HGMMA)"
python3 - <<'PY' 2>&1 | tee "$OUT/sass.log"
import numpy as np, jax.numpy as jnp
from jax_triton_dist.kernels.gemm import matmul_kernel
from jax_triton_dist.runtime import cuda_compile
pos = [("pointer", np.dtype(jnp.bfloat16))] * 3
kw = dict(M=8192, N=8192, K=8192, stride_am=8192, stride_ak=1, stride_bk=8192, stride_bn=1,
          stride_cm=8192, stride_cn=1, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8)
sig, cx = cuda_compile.signature_of(matmul_kernel, pos, kw)
k = cuda_compile.compile_kernel(matmul_kernel, sig, cx, attrs=cuda_compile.divisibility(sig, pos, kw),
                                num_warps=8, num_stages=3)
open("gemm_bf16.cubin", "wb").write(k.asm["cubin"])
PY
CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
echo "HGMMA instructions: $("$CUOBJDUMP" -sass gemm_bf16.cubin | grep -c HGMMA)" | tee -a "$OUT/sass.log"

echo "== benchmarks"
python3 -m jax_triton_dist.bench collectives --platform gpu --iters 20 \
  --json "$OUT/bench_collectives.json" 2>&1 | tee "$OUT/bench.log" | tail -40
python3 -m jax_triton_dist.bench gemm --platform gpu --iters 5 \
  --json "$OUT/bench_gemm.json" 2>&1 | tee "$OUT/bench_gemm.log" | tail -20
exit "$tests_rc"
