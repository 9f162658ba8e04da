"""Control plane at step gaps under host-side variants (issue 16): which knob moves the cost?

Each variant runs afd_ext.bench.control.measure_control_gaps (new counts every step,
8 attention ranks x 2 stages, attention end spinning) at 1, 5, 20 and 50 ms gaps and
prints p50/p99 and the phases. Variants: pinned or not, the receiver's rehearsal
every 0.5 or 0.1 ms; ``env`` is set for the spawned workers (for trying a knob).

    python scripts/diag/control_variants.py [seconds_per_cell]
"""
import sys

from afd_ext.bench.control import format_phases, measure_control_gaps
from afd_ext.testing import _environ

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
GAPS_MS = (1.0, 5.0, 20.0, 50.0)
VARIANTS = [  # name, kind, env, pin, warm_s
    ("shm pinned", "shm", {}, None, None),
    ("shm pinned, rehearsal 0.1 ms", "shm", {}, None, 0.0001),
    ("tcp pinned", "tcp", {}, None, None),
    ("tcp pinned, rehearsal 0.1 ms", "tcp", {}, None, 0.0001),
]


def main() -> None:
    for name, kind, env, pin, warm in VARIANTS:
        sched = [(g * 1000.0, int(min(2000, max(100, SECONDS * 1000 / g))), 20) for g in GAPS_MS]
        try:
            with _environ(env):
                res = measure_control_gaps(kind, sched, distinct=True, pin=pin, warm_s=warm)
        except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        for g, r in zip(GAPS_MS, res):
            print(f"{name:28s} gap {g:4g} ms: p50 {r['p50_us']:7.1f} p99 {r['p99_us']:7.1f} us (n={r['n']}, "
                  f"cpus {r['cpus']}); {format_phases(r)}", flush=True)


if __name__ == "__main__":  # the measurement's workers are spawned: they import this file
    main()
