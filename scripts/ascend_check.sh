#!/usr/bin/env bash
# The Ascend lane's check (CI runs it): makes the triton-ascend environment if it is
# missing (.venv-ascend in the clone), lowers every kernel of kernels/ to HIVM IR at 2 and 8
# ranks with both mappings, checks that their distributed operations survived, and lowers
# the negative controls (which the check must fail). Fails when any of that does not hold.
# Writes OUT_DIR/report.json, OUT_DIR/ASCEND.md (the committed ASCEND.md is a copy) and the
# IR of every kernel under OUT_DIR/<mapping>/<kernel>-r<ranks>/.
#
#   bash scripts/ascend_check.sh OUT_DIR
#
# Needs only Python 3.11: the lowering runs from the source tree (no JAX, no build).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/ascend_check.sh OUT_DIR}
PY=.venv-ascend/bin/python
if ! [ -x "$PY" ] || ! "$PY" -c "import triton.backends.ascend.compiler, ascendnpuir" 2>/dev/null; then
  echo "+ making .venv-ascend (triton-ascend 3.2.0, ascendnpu-ir 1.2.0)"
  rm -rf .venv-ascend
  python3 -m venv .venv-ascend
  "$PY" -m pip install -q triton-ascend==3.2.0 ascendnpu-ir==1.2.0 pybind11 numpy
fi
mkdir -p "$OUT"
"$PY" jax_triton_dist/ascend/worker.py --package jax_triton_dist --out "$OUT" --controls \
  --markdown "$OUT/ASCEND.md" --command "bash scripts/ascend_check.sh $OUT" 2>&1 \
  | tee "$OUT/ascend_check.log"
