"""Issue 16: the tcp channel's per-step paths alternated step by step in one pair of processes (new
counts every step, 8 ranks x 2 stages, end to end), so that every variant sees the same host:

  proxy   the attention end's frames go through its send proxy (ChannelOptions.tcp_proxy, on CPU 3);
          off: the sending thread calls send() itself (the proxy keeps its rounds going meanwhile)
  front   both ends call the plane's native fronts (TcpSendFront / TcpTakeFront, bound at open);
          off: the class's checked Python path (the same native send and take under it)

The FFN end's rounds over its private loopback pair run throughout (the default).

Per gap and variant: end to end p50 / p99, and the p50 of: send (the attention call), wire (call ->
the FFN poll saw the socket readable), take (-> recv_dp_metadata_list returned), in us.

    python scripts/diag/tcp_fronts.py [--steps 200] [GAP_MS ...]   (default 1 5 20 50)
"""
import argparse
import functools
import multiprocessing as mp
import os
import socket
import statistics
import time

VARIANTS = [(p, f) for f in (0, 1) for p in (0, 1)]  # (proxy, front)


def _label(v):
    p, f = v
    return f"proxy {'on ' if p else 'off'} front {'on ' if f else 'off'}"


def _end(role, port, q, gaps, steps):
    from afd_ext import control as cp
    from afd_ext.metadata import AFDControlPayload, AFDDPMetadata
    from afd_ext.topology import Topology

    pinned = (os.cpu_count() or 1) >= 4
    if pinned:
        os.sched_setaffinity(0, {1 if role == "ffn" else 2})
    opts = cp.ChannelOptions.from_env(idle_s=60.0, keep_cpus=(3,) if pinned else None, tcp_proxy=True)
    if role == "ffn":
        ls = socket.create_server(("127.0.0.1", 0))
        q.put(ls.getsockname()[1])
        sock, _ = ls.accept()
        ch = cp.TcpControlChannel(sock, is_sender=False, local_rank=0, peer_rank=1, peer="attention rank 0",
                                  options=opts, abort_check=None)
    else:
        sock = socket.create_connection(("127.0.0.1", port))
        ch = cp.TcpControlChannel(sock, is_sender=True, local_rank=1, peer_rank=0, peer="FFN rank 0",
                                  options=opts, abort_check=None)
    plane = cp.AFDControlPlane(lambda p: None, Topology(1, 1), role, 0, channels={0: ch})
    st = ch._state
    proxy = st.proxy
    send_checked, recv_checked = cp.AFDControlPlane.send_dp_metadata_list, cp.AFDControlPlane.recv_dp_metadata_list
    send_front, recv_front = plane.send_dp_metadata_list, plane.recv_dp_metadata_list
    counts = [(7 * i + 3) % 64 for i in range(8)]
    clock = time.perf_counter_ns  # CLOCK_MONOTONIC, as the native t_ns
    rows = []
    nv = len(VARIANTS)
    if role == "attention":
        time.sleep(0.3)
    step = 0
    for gap in gaps:
        for i in range(nv * steps + 20):
            v = VARIANTS[i % nv]
            if role == "attention":
                st.proxy = proxy if v[0] else None
                p = AFDControlPayload({s: AFDDPMetadata([step % 50 + s] + counts[1:]) for s in range(2)})
                send = send_front if v[1] else functools.partial(send_checked, plane)
                t0 = clock()
                send(p)
                rows.append((t0, clock()))
                deadline = time.perf_counter() + gap / 1e3
                while time.perf_counter() < deadline:
                    pass
            else:
                p = recv_front() if v[1] else recv_checked(plane)
                rows.append((st.t_ns, clock()))
                assert p.dp_metadata_list[0].counts[0] == step % 50, (step, p)
            step += 1
    extra = {}
    if role == "attention" and ch._keeper is not None:
        extra = {"served": ch._native.tcp_proxy_served(ch._keeper), "passes": ch._native.keeper_passes(ch._keeper)}
    elif role == "ffn":
        extra = {"rounds": st.warm_rounds, "rehearsals": st.warm.rehearsals}
    q.put((role, rows, extra))
    time.sleep(0.5)
    plane.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps per variant and gap")
    ap.add_argument("gaps", nargs="*", type=float, default=[1.0, 5.0, 20.0, 50.0])
    a = ap.parse_args()
    from afd_ext.bench.control import _pct

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ffn = ctx.Process(target=_end, args=("ffn", None, q, a.gaps, a.steps))
    ffn.start()
    port = q.get(timeout=60)
    att = ctx.Process(target=_end, args=("attention", port, q, a.gaps, a.steps))
    att.start()
    got = {}
    for _ in range(2):
        role, rows, extra = q.get(timeout=1800)
        got[role] = (rows, extra)
    ffn.join(30)
    att.join(30)
    print(f"attention: {got['attention'][1]}; FFN: {got['ffn'][1]}")
    print("end to end p50 / p99; send, wire, take p50 (us); variants alternated step by step")
    nv = len(VARIANTS)
    per = nv * a.steps + 20
    for n, gap in enumerate(a.gaps):
        cols = {v: ([], [], [], []) for v in range(nv)}
        for i in range(20, per):
            k = n * per + i
            (t0, tr), (seen, ret) = got["attention"][0][k], got["ffn"][0][k]
            c = cols[i % nv]
            c[0].append((ret - t0) / 1e3)
            c[1].append((tr - t0) / 1e3)
            c[2].append((seen - t0) / 1e3)
            c[3].append((ret - seen) / 1e3)
        for v, label in enumerate(map(_label, VARIANTS)):
            e2e, snd, wire, take = (sorted(x) for x in cols[v])
            print(f"  gap {gap:4g} ms  {label}: {statistics.median(e2e):6.1f} / {_pct(e2e, 99):6.1f}   "
                  f"send {statistics.median(snd):5.1f}  wire {statistics.median(wire):5.1f}  "
                  f"take {statistics.median(take):5.1f}")


if __name__ == "__main__":
    main()
