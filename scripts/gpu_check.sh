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

echo "== benchmarks"
python3 -m jax_triton_dist.bench collectives --platform gpu --iters 20 \
  --json "$OUT/bench_collectives.json" 2>&1 | tee "$OUT/bench.log" | tail -40
exit "$tests_rc"
