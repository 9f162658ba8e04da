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

With --touch, blocks of steps alternate between no toucher and a toucher: a thread on another CPU
(scripts/diag/touch_loop.c, through ctypes, GIL released) that reads every cache line of the
chosen memory every --period-us, as a helper thread of the sender could. Side by side, the two
columns say whether the cold cost is the last-level cache's (the toucher keeps it there, and its
page-table lines) or the core's own caches and TLB (it cannot reach those).

    python scripts/diag/control_cold.py [--mib 64] [--steps 500] [--touch code|data|all] [--cpus 1,2]
"""
import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

PHASES = ("call", "encode", "publish", "send total", "copy+crc", "gil", "build", "return", "take total")


def _maps():
    """(start, end, perms, path) of this process's mappings."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[1], parts[5] if len(parts) > 5 else ""))
    return out


def _touch_ranges(what, objects, extra):
    """The (address, length) ranges the toucher reads: 'code' = _C's text and the text of the
    image holding PyDict_Next (libpython or the python binary); 'data' = the given objects and
    extra ranges (ring states, the segment) and both images' writable data; 'all' = both."""
    import afd_ext._C as C

    pyaddr = ctypes.cast(ctypes.pythonapi.PyDict_Next, ctypes.c_void_p).value
    maps = _maps()
    pyimage = next(p for lo, hi, _, p in maps if lo <= pyaddr < hi)
    images = {os.path.realpath(C.__file__), pyimage}
    ranges = []
    for lo, hi, perms, path in maps:
        if path not in images and os.path.realpath(path) not in images:
            continue
        if (what in ("code", "all") and "x" in perms) or (what in ("data", "all") and perms.startswith("rw")):
            ranges.append((lo, hi - lo))
    if what in ("data", "all"):
        ranges += [(id(o), sys.getsizeof(o)) for o in objects] + list(extra)
    return ranges


class Toucher:
    """touch_loop() on a thread of its own CPU, started and stopped per block."""

    def __init__(self, ranges, period_ns, cpu):
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "touch_loop.c")
        so = os.path.join(tempfile.mkdtemp(prefix="afdtouch"), "touch_loop.so")
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", so, src], check=True)
        self.lib = ctypes.CDLL(so)
        self.lib.touch_loop.restype = ctypes.c_uint64

        class Range(ctypes.Structure):
            _fields_ = [("p", ctypes.c_void_p), ("n", ctypes.c_uint64)]

        self.ranges = (Range * len(ranges))(*[Range(a, n) for a, n in ranges])
        self.nbytes = sum(n for _, n in ranges)
        self.period_ns, self.cpu = period_ns, cpu
        self.stop, self.pass_ns = ctypes.c_int(0), ctypes.c_int64(0)
        self.thread = None

    def start(self):
        self.stop.value = 0

        def run():
            if self.cpu is not None:
                os.sched_setaffinity(0, {self.cpu})  # this thread only
            self.lib.touch_loop(self.ranges, len(self.ranges), self.period_ns, ctypes.byref(self.stop),
                                ctypes.byref(self.pass_ns))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        time.sleep(0.005)

    def end(self):
        self.stop.value = 1
        self.thread.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="the walk before each call (0: hot)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--touch", choices=("code", "data", "all"), help="alternate blocks without/with a toucher")
    ap.add_argument("--period-us", type=float, default=500.0)
    ap.add_argument("--block", type=int, default=25, help="steps per block (--touch)")
    ap.add_argument("--cpus", default="1,2", help="the probe's CPU, the toucher's CPU ('' : unpinned)")
    args = ap.parse_args()

    from afd_ext import control as cp
    from afd_ext.control.channel import RingState
    from afd_ext.control.shm import ShmControlChannel
    from afd_ext.metadata import AFDControlPayload, AFDDPMetadata

    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else [None, None]
    if cpus[0] is not None:
        os.sched_setaffinity(0, {cpus[0]})
    opts = cp.ChannelOptions.from_env(idle_s=60.0)
    rx = ShmControlChannel.create("afdcold", local_rank=0, peer_rank=1, peer="attention rank 0", options=opts)
    tx = ShmControlChannel.attach(rx.name, local_rank=1, peer_rank=0, peer="FFN rank 0", options=opts)
    rx.wait_attached(time.monotonic() + 5)
    walk = np.ones(max(1, args.mib << 17), dtype=np.float64)
    clock = time.perf_counter_ns
    state, sender = rx._state, tx._state
    state.stamps = sender.stamps = 1  # the native stamps (RingState): t_mark, t_ns, t_built
    started = [0]

    def refuse(taken):
        raise RuntimeError(f"the front fell back ({taken!r})")

    def prepare():
        if args.mib:
            walk.sum()
        started[0] = clock()
        return 1_000_000

    send = tx.send_front(lambda p: None, refuse)
    take = rx.take_front(64, 1024, prepare, refuse)
    counts = [(7 * i + 3) % 64 for i in range(8)]
    toucher = None
    if args.touch:
        seg = (sender.hdr, 256 + sender.nslots * sender.stride)
        extra = [(tx._state_addr, ctypes.sizeof(RingState)), (rx._state_addr, ctypes.sizeof(RingState)), seg]
        objects = [send, take, type(send), type(take), AFDControlPayload, AFDDPMetadata]
        toucher = Toucher(_touch_ranges(args.touch, objects, extra), int(args.period_us * 1e3), cpus[1])
    cols = ("off", "on") if toucher else ("",)
    phases = {c: {k: [] for k in PHASES} for c in cols}
    for i in range(args.steps):
        col = cols[(i // args.block) % len(cols)]
        if toucher and i % args.block == 0:
            (toucher.start if col == "on" else (lambda: None))()
        if args.mib:
            walk.sum()
        p = AFDControlPayload({s: AFDDPMetadata([i % 50 + s] + counts[1:]) for s in range(2)})  # as a runner
        t0 = clock()
        send(p)
        t1 = clock()
        got = take()
        t2 = clock()
        assert got.dp_metadata_list[0].counts[0] == i % 50, (i, got)
        if toucher and col == "on" and (i + 1) % args.block == 0:
            toucher.end()
        if i % args.block < 2:
            continue  # each block's first steps: the toucher (or its absence) not yet in effect
        ph = phases[col]
        ph["call"].append(sender.t_mark - t0)  # into C, the check, the native send entered
        ph["encode"].append(sender.t_ns - sender.t_mark)  # the payload read and encoded
        ph["publish"].append(t1 - sender.t_ns)  # the slot written, the doorbell, back to the caller
        ph["send total"].append(t1 - t0)
        ph["copy+crc"].append(state.t_ns - started[0])
        ph["gil"].append(state.t_mark - state.t_ns)
        ph["build"].append(state.t_built - state.t_mark)
        ph["return"].append(t2 - state.t_built)
        ph["take total"].append(t2 - started[0])
    if toucher and toucher.thread.is_alive():
        toucher.end()
    n = len(phases[cols[0]]["call"])
    print(f"caches evicted by a {args.mib} MiB walk before each call; p50 / p90 (us), {n} steps per column"
          + (f"; toucher '{args.touch}': {toucher.nbytes / 2**20:.1f} MiB every {args.period_us:g} us, "
             f"a pass {toucher.pass_ns.value / 1e3:.0f} us, CPUs {args.cpus}" if toucher else ""))
    print(f"  {'':<11}" + "".join(f"{c:>17}" for c in cols))
    for k in PHASES:
        cells = []
        for c in cols:
            xs = sorted(phases[c][k])
            cells.append(f"{statistics.median(xs) / 1e3:7.2f} / {xs[int(0.9 * len(xs))] / 1e3:6.2f}")
        print(f"  {k:<11}" + "".join(f"{s:>17}" for s in cells))
    tx.close()
    rx.close()


if __name__ == "__main__":
    main()
