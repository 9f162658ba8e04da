"""Control plane at step gaps under host-side variants (issue 16): which knob moves the cost?

Each variant runs afd_ext.bench.control.measure_control_gaps (new counts every step,
8 attention ranks x 2 stages, attention end spinning) at 1, 20 and 50 ms gaps and
prints p50/p99 and the phases. Variants: pinned or not, the receiver's rehearsal
on or off, the native poll's pause hint on or off (AFD_CONTROL_PAUSE, read by the
worker processes when the compiled core loads).

    python scripts/diag/control_variants.py [seconds_per_cell]
"""
import os
import sys

from afd_ext.bench.control import format_phases, measure_control_gaps

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
GAPS_MS = (1.0, 20.0, 50.0)
VARIANTS = [  # name, kind, env, pin, warm_s
    ("shm pinned", "shm", {}, None, None),
    ("shm pinned, no pause", "shm", {"AFD_CONTROL_PAUSE": "0"}, None, None),
    ("shm not pinned", "shm", {}, False, None),
    ("shm pinned, no rehearsal", "shm", {}, None, 0.0),
    ("tcp pinned", "tcp", {}, None, None),
    ("tcp pinned, no pause", "tcp", {"AFD_CONTROL_PAUSE": "0"}, None, None),
]

def main() -> None:
    for name, kind, env, pin, warm in VARIANTS:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        sched = [(g * 1000.0, int(min(2000, max(100, SECONDS * 1000 / g))), 20) for g in GAPS_MS]
        try:
            res = measure_control_gaps(kind, sched, distinct=True, pin=pin, warm_s=warm)
        except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        for g, r in zip(GAPS_MS, res):
            print(f"{name:28s} gap {g:4g} ms: p50 {r['p50_us']:7.1f} p99 {r['p99_us']:7.1f} us (n={r['n']}, "
                  f"cpus {r['cpus']}); {format_phases(r)}", flush=True)


if __name__ == "__main__":  # the measurement's workers are spawned: they import this file
    main()
