#!/usr/bin/env bash
# Issue #35: the peer-memory plane against minimal put/wait kernels, in one call on
# the one-H200 machine (two GPUs: attention on cuda:0, FFN on cuda:1). From the repo root:
#
#   OUT=... bash scripts/peer_structure.sh            # ~3-5 min
#
# 1. build afd_ext against the machine's torch (SKIP_BUILD=1 skips it);
# 2. `afd-ext bench --peer-structure`: floor / min / fused / plane / plane_pdl at 1..8192 tokens, µs per
#    round trip and plane/min ratio (every case validated once on fresh data);
# 3. the PyTorch profiler on one concurrent replay of min, fused, plane, plane_pdl at 1 and 8192 tokens:
#    per-kernel mean duration, grid, block, registers;
# 4. ncu (kernel-serialised, so one eager round trip on ONE stream: --serial) of min and plane
#    at 1 and 8192 tokens: duration, launch shape, registers, occupancy limits, throughput;
#    plus the compiler's register/spill report of both kernel sets.
# Files in $OUT (at most 8): build.log bench.log peer_structure.json profile.log
# peer_structure_profile.json ncu.csv ncu.log summary.txt
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
PS=($PY -m afd_ext bench --peer-structure)
step bench 120 "${PS[@]}" --out "$OUT"
step profile 90 "${PS[@]}" --structures min,fused,plane,plane_pdl --tokens 1,8192 --replays 2 --torch-profile --out "$OUT"
NCU=${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
if [ -n "$NCU" ]; then
  step ncu 120 "$NCU" --clock-control none --kernel-name "regex:min_|peer_" --csv --log-file "$OUT/ncu.csv" \
    --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_warps,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed \
    "${PS[@]}" --serial --structures min,plane --tokens 1,8192
  $PY -m afd_ext.bench.peer_structure --ncu-summary "$OUT/ncu.csv" | tee -a "$OUT/profile.log"
else
  echo "=== ncu: not found" | tee -a "$OUT/summary.txt"
fi
{ echo; echo "# minimal kernels (ptxas -v)"; cat "$XDG_CACHE_HOME"/afd_ext_peer_structure/*.ptxas.txt 2>/dev/null
  echo "# the plane's kernels (cuobjdump --dump-resource-usage)"
  "$CUDA_HOME/bin/cuobjdump" --dump-resource-usage afd_ext/_C*.so 2>&1 | grep -A1 -i "peer_"
  echo "# fences, atomics and system-scope stores in the SASS of both kernel sets"
  for f in afd_ext/_C*.so "$XDG_CACHE_HOME"/afd_ext_peer_structure/ps_*.so; do
    "$CUDA_HOME/bin/cuobjdump" --dump-sass "$f" 2>/dev/null | awk '/Function :/ {keep = ($0 ~ /peer_|min_|floor_/);
      if (keep) print; next} keep && /MEMBAR|FENCE|ERRBAR|ATOM|RED\.|STRONG\.SYS|CCTL|EXIT/ {print}'
  done; } | tee -a "$OUT/profile.log" | grep -E "entry|REG|Used|Function" | head -30
echo; echo "=== table"; sed -n '/^µs per round trip/,$p' "$OUT/bench.log"
exit $status
