#!/usr/bin/env bash
# The GPU tier in one call on a GPU machine (one GPU: nvidia-h200, or two:
# nvidia-h200-x2): build against the machine's torch, run the `gpu`-marked tests,
# the timing scripts, the benchmark and the demo; logs and JSON land in $OUT (or
# ./gpu-out). Process placement (afd_ext.tools.testing.place_processes) is printed first:
# one GPU per process where there are enough, attention/FFN on GPUs 0/1 on two,
# every process on GPU 0 with its own NCCL_HOSTID (NCCL over sockets, correctness
# only) on one; AFD_TEST_SHARE_GPU=1 forces the last on several GPUs. When 1A1F
# cannot get a GPU per process, the timing phases (time, bench-quick, bench) are
# skipped with a line saying why (not a failure), and tests that need distinct
# GPUs skip saying why.
#
#   bash scripts/gpu_tier.sh [phase ...]
#
# Phases (default: build tests time peer-structure bench bench-fp8 demo):
#   build        pip install -e . against the machine's torch, then `afd-ext info`
#   tests        pytest -m gpu $GPU_TESTS (default: tests), -k "$PYTEST_K" when set, per-test durations.
#                TEST_JOBS=3 (only without GPU_TESTS) runs three pytest processes at once, each
#                on its own files: connector | graphs + ops | everything else (demo, bench, new
#                files); TEST_JOBS=5 also runs the peer connector and the peer kernels on their
#                own, TEST_JOBS=6 the FP8 tests too, 7 the bench's GPU tests; logs gpu-tests-N.log, junit gpu-junit-N.xml. On one GPU
#                their processes all share it: correctness is unaffected, wall time drops.
#   time         tests/gpu/time_graph_exchange.py (per-layer exchange, eager vs CUDA graph)
#   bench-quick  afd-ext bench --quick (two variants, eager): the smoke test
#   bench-check  afd-ext bench --check: every variant bit-exact, eager + graph
#   peer-structure  afd-ext bench --peer-structure (issue #35): the peer-memory plane against
#                minimal put/wait kernels, ratio per size; with two GPUs attention on cuda:0 and
#                FFN on cuda:1 (NVLink), and again both on cuda:0 (the one-GPU records)
#   bench        the default sweep (every default variant: ours_per_tensor, reference, raw, peer;
#                one process per GPU on two GPUs), $BENCH_ARGS appended
#   bench-fp8    FP8 hidden states against bf16 on both GPU transports (bytes per token and time;
#                docs/fp8.md): ours_per_tensor, ours_fp8, peer, peer_fp8
#   demo         the demo at 1A1F --dims deepseek-v2-lite and at 2A1F (NCCL)
# Every phase runs under `timeout` (PHASE_TIMEOUT seconds, default 300; the tests
# phase TESTS_TIMEOUT, default 450).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
# NVLink multicast stays off on shared machines (see docs/gpu-test-results.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
phases=${*:-build tests time peer-structure bench bench-fp8 demo}
PY=${PY:-python3}
status=0
run() {  # run NAME CMD...: log to $OUT/NAME.log, remember failures, keep going
  local name=$1; shift
  local limit=${PHASE_TIMEOUT:-300}
  case $name in gpu-tests*) limit=${TESTS_TIMEOUT:-450} ;; esac
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || status=1
}
{
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  $PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
  $PY -c 'import transformers; print("transformers", transformers.__version__)' 2>&1
  # afd_ext.tools.testing needs only torch (no build): the arrangement every phase below uses.
  $PY -c 'from afd_ext.tools.testing import place_processes as p, visible_gpu_count as n
if n() < 1: print("arrangement: no CUDA GPU visible")
else: print("arrangement (1A1F):", p(1, 1).describe()); print("arrangement (2A1F):", p(2, 1).describe())' 2>&1
} | tee "$OUT/summary.txt"
# 1 when 1A1F has a GPU per process (timings mean something), else 0.
timings_ok=$($PY -c 'from afd_ext.tools.testing import place_processes as p, visible_gpu_count as n
print(int(n() > 0 and p(1, 1).timings_meaningful))' 2>/dev/null || echo 0)
# The gpu-marked tests (paths appended), verbose, with per-test durations.
pytest_gpu=("$PY" -m pytest -m gpu -v -rA -p no:cacheprovider --durations=0 --timeout 240)
[ -n "${PYTEST_K:-}" ] && pytest_gpu+=(-k "$PYTEST_K")
timed() {  # timed NAME CMD...: run a timing phase only where timings mean something
  if [ "$timings_ok" = 1 ]; then run "$@"; else
    echo "=== $1: skipped: timings need a GPU per process (see the arrangement above)" | tee -a "$OUT/summary.txt"; fi
}
for phase in $phases; do
  case $phase in
    build) run build $PY -m pip install --no-build-isolation --no-deps -e . && run info $PY -m afd_ext info ;;
    tests) if [ "${TEST_JOBS:-1}" -gt 1 ] && [ -z "${GPU_TESTS:-}" ]; then
             # TEST_JOBS=3: connector NCCL | graphs + ops | the rest; TEST_JOBS=5 also
             # takes the peer connector and the peer kernels out of the rest, 6 the FP8 tests, 7 the bench's.
             groups=(tests/gpu/test_connector_nccl.py "tests/gpu/test_graphs_gpu.py tests/gpu/test_ops_gpu.py")
             [ "$TEST_JOBS" -ge 5 ] && groups+=(tests/gpu/test_connector_peer.py tests/gpu/test_peer_gpu.py)
             [ "$TEST_JOBS" -ge 6 ] && groups+=(tests/gpu/test_fp8_gpu.py)
             [ "$TEST_JOBS" -ge 7 ] && groups+=(tests/test_bench.py)
             rest="tests"
             for g in "${groups[@]}"; do for f in $g; do rest+=" --ignore=$f"; done; done
             groups+=("$rest")
             for i in "${!groups[@]}"; do
               # shellcheck disable=SC2086  # a group holds several words on purpose
               run gpu-tests-$((i + 1)) "${pytest_gpu[@]}" ${groups[$i]} --junitxml "$OUT/gpu-junit-$((i + 1)).xml" >/dev/null &
             done
             wait
             for i in "${!groups[@]}"; do tail -n 60 "$OUT/gpu-tests-$((i + 1)).log"; done
             grep -q "^=== gpu-tests-[0-9]*: rc=[^0]" "$OUT/summary.txt" && status=1
           else
             # shellcheck disable=SC2086
             run gpu-tests "${pytest_gpu[@]}" ${GPU_TESTS:-tests} --junitxml "$OUT/gpu-junit.xml"
           fi ;;
    time) timed time-graph $PY tests/gpu/time_graph_exchange.py --out "$OUT/time_graph.json" ;;
    bench-quick) timed bench-quick $PY -m afd_ext bench --quick --modes eager --variants ours_per_tensor,raw \
             --no-progress --case-timeout 30 --timeout 120 --out "$OUT/bench-quick" ;;
    bench-check) run bench-check $PY -m afd_ext bench --check --no-progress --case-timeout 30 --timeout 160 \
             --out "$OUT/bench-check" ;;
    peer-structure)
          ngpu=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
          if [ "$ngpu" -ge 1 ]; then
            run peer-structure $PY -m afd_ext bench --peer-structure --out "$OUT/peer-structure"
            if [ "$ngpu" -ge 2 ]; then
              run peer-structure-1gpu env AFD_PEER_STRUCTURE_ONE_GPU=1 \
                $PY -m afd_ext bench --peer-structure --out "$OUT/peer-structure-1gpu"
            fi
          else
            echo "=== peer-structure: skipped: no CUDA GPU visible" | tee -a "$OUT/summary.txt"
          fi ;;
    bench-fp8) timed bench-fp8 $PY -m afd_ext bench --no-progress --variants ours_per_tensor,ours_fp8,peer,peer_fp8 \
             --out "$OUT/bench-fp8" ;;
    bench) timed bench $PY -m afd_ext bench --no-progress ${BENCH_ARGS:-} --out "$OUT/bench" ;;
    demo) run demo-1a1f $PY -m afd_ext demo --backend nccl --topology 1A1F --dims deepseek-v2-lite --json "$OUT/demo-1a1f.json"
          run demo-2a1f $PY -m afd_ext demo --backend nccl --topology 2A1F --json "$OUT/demo-2a1f.json" ;;
    *) echo "unknown phase $phase"; status=2 ;;
  esac
done
cat "$OUT/summary.txt"
exit $status
