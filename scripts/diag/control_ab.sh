#!/usr/bin/env bash
# Two trees' control planes side by side on one host (issue 16): build OLD_DIR's compiled core in
# place, then alternate OLD and this tree (installed) ROUNDS times, shm and tcp at 1/5/20/50 ms,
# new counts every step, no reference column; a pair of runs minutes apart sees the same host.
#
#   bash scripts/diag/control_ab.sh OLD_DIR [ROUNDS]     (logs: $OUT/ab-{old,new}-N.log)
set -uo pipefail
OLD=$(cd "$1" && pwd); ROUNDS=${2:-2}; OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
(cd "$OLD" && python3 setup.py -q build_ext --inplace) > "$OUT/ab-old-build.log" 2>&1 || { echo "old build failed"; exit 1; }
table='from afd_ext.bench.control import control_main as m; import inspect as i
kw = {"rounds": 1} if "rounds" in i.signature(m).parameters else {}
m((1.0, 5.0, 20.0, 50.0), ("shm", "tcp"), reference=False, **kw)'
for n in $(seq 1 "$ROUNDS"); do
  for which in old new; do
    if [ $which = old ]; then pp=$OLD; else pp=; fi
    echo "=== $which $n"
    (cd /tmp && PYTHONPATH=$pp python3 -c "import afd_ext, sys; print(afd_ext.__file__, file=sys.stderr)
$table") > "$OUT/ab-$which-$n.log" 2>&1
    grep -E "^\| [0-9]" "$OUT/ab-$which-$n.log"
  done
done
