"""Issue 16: each end's per-step call on cold caches, in one process (no second core, no host noise).

Before every timed call a walk over a buffer larger than the last-level cache (default 64 MiB)
evicts the caches and TLBs, as the model's own work does between two steps of a serving rank; then
a new payload is built (as a runner builds it just before its send) and the attention end's send
front is timed (into C and the check, -> encoded, -> published and
back to the caller), and the FFN end's take front on a payload
already published, split by its native stamps: the wait's start (prepare returned) -> copy and CRC
done, -> GIL back, -> payload built, -> the caller's clock read after the return. A footprint
change on either path shows here in whole microseconds, reproducibly, where the two-process bench
needs a quiet host.

    python scripts/diag/control_cold.py [MIB] [STEPS]      (default 64 500; MIB 0: hot)
"""
import statistics
import sys
import time

import numpy as np


def main():
    from afd_ext import control as cp
    from afd_ext.control.shm import ShmControlChannel
    from afd_ext.metadata import AFDControlPayload, AFDDPMetadata

    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 500
    opts = cp.ChannelOptions.from_env(idle_s=60.0)
    rx = ShmControlChannel.create("afdcold", local_rank=0, peer_rank=1, peer="attention rank 0", options=opts)
    tx = ShmControlChannel.attach(rx.name, local_rank=1, peer_rank=0, peer="FFN rank 0", options=opts)
    rx.wait_attached(time.monotonic() + 5)
    walk = np.ones(max(1, mib << 17), dtype=np.float64)
    clock = time.perf_counter_ns
    state, sender = rx._state, tx._state
    state.stamps = sender.stamps = 1  # the native stamps (RingState): t_mark, t_ns, t_built
    started = [0]

    def refuse(taken):
        raise RuntimeError(f"the front fell back ({taken!r})")

    def prepare():
        if mib:
            walk.sum()
        started[0] = clock()
        return 1_000_000

    send = tx.send_front(lambda p: None, refuse)
    take = rx.take_front(64, 1024, prepare, refuse)
    counts = [(7 * i + 3) % 64 for i in range(8)]
    phases = {k: [] for k in ("call", "encode", "publish", "send total", "copy+crc", "gil", "build", "return",
                              "take total")}
    for i in range(steps):
        if mib:
            walk.sum()
        p = AFDControlPayload({s: AFDDPMetadata([i % 50 + s] + counts[1:]) for s in range(2)})  # as a runner
        t0 = clock()
        send(p)
        t1 = clock()
        got = take()
        t2 = clock()
        assert got.dp_metadata_list[0].counts[0] == i % 50, (i, got)
        phases["call"].append(sender.t_mark - t0)  # into C, the check, the native send entered
        phases["encode"].append(sender.t_ns - sender.t_mark)  # the payload read and encoded
        phases["publish"].append(t1 - sender.t_ns)  # the slot written, the doorbell, back to the caller
        phases["send total"].append(t1 - t0)
        phases["copy+crc"].append(state.t_ns - started[0])
        phases["gil"].append(state.t_mark - state.t_ns)
        phases["build"].append(state.t_built - state.t_mark)
        phases["return"].append(t2 - state.t_built)
        phases["take total"].append(t2 - started[0])
    print(f"caches evicted by a {mib} MiB walk before each call; p50 / p90 (us) over {steps - 20} steps")
    for k, xs in phases.items():
        xs = sorted(xs[20:])
        print(f"  {k:<11} {statistics.median(xs) / 1e3:6.2f} / {xs[int(0.9 * len(xs))] / 1e3:6.2f}")
    tx.close()
    rx.close()


if __name__ == "__main__":
    main()
