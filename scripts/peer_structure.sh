#!/usr/bin/env bash
# Issue #35: the peer-memory plane against minimal put/wait kernels, in one call on
# the one-H200 machine (two GPUs: attention on cuda:0, FFN on cuda:1). From the repo root:
#
#   OUT=... bash scripts/peer_structure.sh            # ~2 min
#
# 1. build afd_ext against the machine's torch (SKIP_BUILD=1 skips it);
# 2. `afd-ext bench --peer-structure`: floor / min / fused / plane / plane_pdl at 1..8192 tokens, µs per
#    round trip and plane/min ratio (every case validated once on fresh data).
# The profiles that explained the plane's gap (runs 54-55) are in docs/gpu-test-results.md; to profile again,
# run ncu or nsys around the same command.
# Files in $OUT: build.log bench.log peer_structure.json summary.txt
set -uo pipefail
OUT=${OUT:-$PWD/peer-structure-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/afd-cache}
PY=${PY:-python3}
status=0
step() {  # step NAME LIMIT CMD...: log to $OUT/NAME.log, keep going on failure
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || status=1
  return "$rc"
}
{ echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; } |
  tee "$OUT/summary.txt"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  step build 240 $PY -m pip install --no-build-isolation --no-deps -e . || { echo "build failed"; exit 1; }
fi
step bench 120 $PY -m afd_ext bench --peer-structure --out "$OUT"
echo; echo "=== table"; sed -n '/^µs per round trip/,$p' "$OUT/bench.log"
exit $status
