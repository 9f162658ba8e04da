"""Issue 16: the plane's per-step paths alternated step by step in one pair of processes (so every
variant sees the same host noise). shm, new counts every step, 8 ranks x 2 stages, end to end.

Variants:
  "frame":   session 6's plane: a Python frame around one native call on each end (bytecode for
             bytecode up to the call and back), the call a functools.partial of a module function;
  "partial": this tree's fronts, each behind a functools.partial with no arguments: one wrapper
             object more on the way in (session 7's partial also held an argument tuple, the
             ring's int and a module function, which this cannot rebuild: a lower bound);
  "front":   this tree's plane: its per-step calls are the channels' native front objects.

With --rehearsal, the variants are instead the FFN receiver's rehearsal between steps (both with
this tree's fronts):
  "take":    it rehearses its own take alone (WarmState.sender = 0);
  "both":    it also sends the payload as the attention end does, on its private scratch ring
             (sender = 1, the default).

With --keeper, the variants are the attention process's keeper (ChannelOptions.keep_s) absent
("alone") or running through the gap before the step ("keeper"), started and stopped right after
each send.

    python scripts/diag/control_fronts.py [--rehearsal | --keeper] [GAP_MS ...]
    (default 20 50; 300 steps per variant)
"""
import functools
import multiprocessing as mp
import os
import statistics
import sys
import time

STEPS = 300
VARIANTS = ("frame", "partial", "front")
REHEARSALS = ("take", "both")
KEEPERS = ("alone", "keeper")


class FramePlane:
    """Session 6's per-step calls: a Python frame around the channel's one native call."""

    def __init__(self, plane, ch):
        self._open = True
        self._check_send = None
        self._plane = plane
        self.recv_timeout_s = None
        self.max_payload_bytes = plane.max_payload_bytes
        self._ch = ch
        if ch.is_sender:
            self._fast_send = functools.partial(ch._native.send_payload, ch._state_addr)
        else:
            self._fast_take = functools.partial(ch._native.take, ch._state_addr)

    def send_dp_metadata_list(self, payload):
        if not self._open:
            raise RuntimeError("closed")
        if self._check_send is not None:
            self._check_send(payload)
        fast = self._fast_send
        if fast is not None and fast(payload) == 0:
            return
        raise RuntimeError("declined")

    def recv_dp_metadata_list(self):
        fast = self._fast_take
        data = None
        if fast is not None:
            started = time.monotonic()  # noqa: F841 - as the previous plane did
            ns = self._ch.first_slice_ns(self.recv_timeout_s, 64, 1024, self.max_payload_bytes)
            if ns:
                got = fast(ns, 64, 1024)
                if type(got) is bytes:
                    data = got
                elif type(got) is not int:
                    return got
        self._plane._recv_started = None
        return self._plane._recv_checked(data)  # late (start-up): the checked path, as before


class PartialPlane:
    """The plane's fronts, each behind a functools.partial with no arguments (one wrapper more)."""

    def __init__(self, plane):
        for name in ("send_dp_metadata_list", "recv_dp_metadata_list"):
            if name in vars(plane):
                setattr(self, name, functools.partial(vars(plane)[name]))


def _end(role, name, q, gaps, spin, mode):
    from afd_ext import control as cp
    from afd_ext.control.shm import ShmControlChannel
    from afd_ext.metadata import AFDControlPayload, AFDDPMetadata
    from afd_ext.topology import Topology

    pinned = (os.cpu_count() or 1) >= 4
    if pinned:
        os.sched_setaffinity(0, {1 if role == "ffn" else 2})
    opts = cp.ChannelOptions.from_env(idle_s=60.0, **({"keep_s": 0.0} if mode == "keeper" else {}))
    if role == "ffn":
        ch = ShmControlChannel.create("afdfr", local_rank=0, peer_rank=1, peer="attention rank 0", options=opts)
        q.put(ch.name)
        ch.wait_attached(time.monotonic() + 30)
    else:
        ch = ShmControlChannel.attach(name, local_rank=1, peer_rank=0, peer="FFN rank 0", options=opts)
    plane = cp.AFDControlPlane(lambda p: None, Topology(1, 1), role, 0, channels={0: ch})
    assert "send_dp_metadata_list" in vars(plane) or "recv_dp_metadata_list" in vars(plane)  # fronts bound
    if mode == "rehearsal":
        ends = (plane,) * len(REHEARSALS)
    elif mode == "keeper":
        ends = (plane,) * len(KEEPERS)
    else:
        ends = (FramePlane(plane, ch), PartialPlane(plane), plane)
    keeper = None
    passes: list = []  # each keeper's passes (-1: it did not start)
    if role == "attention":
        time.sleep(0.3)  # the FFN end is waiting
    counts = [(7 * i + 3) % 64 for i in range(8)]
    clock = time.perf_counter_ns
    stamps = []
    step = 0
    for gap in gaps:
        for i in range(len(ends) * STEPS + 20):
            end = ends[i % len(ends)]
            if role == "attention":
                p = AFDControlPayload({s: AFDDPMetadata([step % 50 + s] + counts[1:]) for s in range(2)})
                t0 = clock()
                end.send_dp_metadata_list(p)
                stamps.append(t0)
                if mode == "keeper":  # the next step's variant, through the gap before it
                    if (i + 1) % len(ends) == 1 and keeper is None:
                        if pinned:  # as the bench: the keeper takes CPU 3, this thread stays on CPU 2
                            os.sched_setaffinity(0, {2, 3})
                        keeper = ch._native.keeper_start(ch._state_addr, (ch._state, ch._anchor), 500_000,
                                                         60_000_000_000)
                        if pinned:
                            os.sched_setaffinity(0, {2})
                    elif (i + 1) % len(ends) == 0 and keeper is not None:
                        passes.append(ch._native.keeper_stop(keeper))
                        keeper = None
                deadline = time.perf_counter() + gap / 1e3
                if spin:
                    while time.perf_counter() < deadline:
                        pass
                else:
                    time.sleep(gap / 1e3)
            else:
                if mode == "rehearsal":  # set before the wait: the rehearsals of the gap before step i are variant i's
                    ch._state.warm.sender = i % len(ends)
                p = end.recv_dp_metadata_list()
                stamps.append(clock())
                assert p.dp_metadata_list[0].counts[0] == step % 50, (step, p)
            step += 1
    if passes:
        print(f"keepers: {len(passes)}, passes each: min {min(passes)}, median {statistics.median(passes)}", flush=True)
    q.put((role, stamps))
    time.sleep(0.5)
    plane.close()


def main():
    from afd_ext.bench.control import _pct  # the bench's percentile (nearest rank)

    mode = "rehearsal" if "--rehearsal" in sys.argv[1:] else ("keeper" if "--keeper" in sys.argv[1:] else "fronts")
    gaps = [float(g) for g in sys.argv[1:] if not g.startswith("--")] or [20.0, 50.0]
    labels = {"rehearsal": REHEARSALS, "keeper": KEEPERS}.get(mode, VARIANTS)
    spin = (os.cpu_count() or 1) >= 4
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ffn = ctx.Process(target=_end, args=("ffn", None, q, gaps, spin, mode))
    ffn.start()
    name = q.get(timeout=60)
    att = ctx.Process(target=_end, args=("attention", name, q, gaps, spin, mode))
    att.start()
    got = dict(q.get(timeout=900) for _ in range(2))
    ffn.join(30)
    att.join(30)
    nv = len(labels)
    per = nv * STEPS + 20
    print(f"sender {'spins' if spin else 'sleeps'}; end to end p50 / p99 (us), variants alternated step by step")
    for n, gap in enumerate(gaps):
        lat = {v: [] for v in range(nv)}
        for i in range(20, per):  # the first 20 steps warm up
            k = n * per + i
            lat[i % nv].append((got["ffn"][k] - got["attention"][k]) / 1e3)
        cells = []
        for v, label in enumerate(labels):
            xs = sorted(lat[v])
            cells.append(f"{label} {statistics.median(xs):.1f} / {_pct(xs, 99):.1f}")
        print(f"  gap {gap:g} ms: " + ", ".join(cells))


if __name__ == "__main__":
    main()
