"""AFD across two hosts under torchrun: two network namespaces joined by a veth pair.

Each "host" is a network namespace with its own address (10.77.0.1 and
10.77.0.2 on a veth pair), its own host name (a UTS namespace) and an
``/etc/hosts`` that resolves that name to its address (bind-mounted in the
mount namespace ``ip netns exec`` gives each process), as on a real machine.
Loopback is separate per host, so an address that only works on one machine
(127.0.0.1 advertised to a peer) fails here as it would across machines. One
torchrun agent runs per host with a static rendezvous; the only address
configured anywhere is ``--master-addr``, the store host's (FFN rank 0 is
torchrun rank 0, on node rank 0): no AFD_HOST, AFD_PORT, AFD_CONTROL_ADDR,
GLOO_SOCKET_IFNAME or MASTER_ADDR in the environment.

The namespace tests need root (CAP_NET_ADMIN, CAP_SYS_ADMIN), ``ip``
(iproute2) and ``unshare`` (util-linux); elsewhere they skip, saying which is
missing. The same example also runs as two nodes on one host (``afd-ext
launch`` for one, plain torchrun for the other; no namespaces), which needs
nothing.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "multinode.py")
WORKER = str(REPO / "tests" / "multinode_worker.py")
EXAMPLE_LINE = re.compile(r"multinode example: (\w+) rank (\d+) on (\S+): 4 steps, (\d+) rows exact")
STORE_HOST = "10.77.0.1"
HOSTS = (("afd-host-a", STORE_HOST), ("afd-host-b", "10.77.0.2"))
# Variables that would configure an address or a role; the tests run without them.
_SCRUB = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GLOO_SOCKET_IFNAME",
          "NCCL_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFD_") and k not in _SCRUB}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start ``argv`` in its own process group, its output in an unnamed temporary file (never a full pipe)."""
    import tempfile

    log = tempfile.TemporaryFile("w+")
    try:
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                             env=env, cwd=REPO, start_new_session=True)
    except BaseException:
        log.close()
        raise
    p.log = log  # type: ignore[attr-defined]
    return p


def _torchrun(node_rank: int, nproc: int, master_addr: str, master_port: int, script: list[str]) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
            "--nproc-per-node", str(nproc), "--master-addr", master_addr, "--master-port", str(master_port),
            "--max-restarts", "0", "--monitor-interval", "0.2", *script]


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str]]:
    """Wait for every agent against one deadline, then stop what still runs; ``[(exit code, output)]``.

    A late agent gets SIGTERM first, so torchrun stops its ranks (they run in
    sessions of their own and would outlive a killed agent), then SIGKILL.

    Raises:
        AssertionError: an agent still ran at the deadline (with every agent's output).
    """
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        late = [i for i, p in enumerate(procs) if p.poll() is None]
    finally:
        _stop(procs)
    out = []
    for p in procs:
        p.log.seek(0)  # type: ignore[attr-defined]
        out.append((p.returncode, p.log.read()))  # type: ignore[attr-defined]
        p.log.close()  # type: ignore[attr-defined]
    if late:
        logs = "\n".join(f"--- agent {i} ---\n{text[-4000:]}" for i, (_, text) in enumerate(out))
        raise AssertionError(f"torchrun agents {late} still running after {timeout_s:.0f} s\n{logs}")
    return out


def _stop(procs: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        running = [p for p in procs if p.poll() is None]
        for p in running:
            os.killpg(p.pid, sig)
        for p in running:
            try:
                p.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass


# ---------------------------------------------------------------------------
# Two hosts: network + UTS namespaces
# ---------------------------------------------------------------------------


def _cannot_make_namespaces() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN); run as root"
    for tool, pkg in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (package {pkg})"
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class TwoHosts:
    """Two network namespaces on a veth pair, each with its own host name and /etc/hosts."""

    def __init__(self, tmp: Path):
        tag = f"{os.getpid() % 100000}"
        self.netns = [f"afd{tag}a", f"afd{tag}b"]
        self.tmp = tmp
        self.created: list[str] = []

    def __enter__(self) -> "TwoHosts":
        veth = [f"afv{self.netns[0][3:]}", f"afv{self.netns[1][3:]}"]
        try:
            for ns in self.netns:
                _ip("netns", "add", ns)
                self.created.append(ns)
            _ip("link", "add", veth[0], "netns", self.netns[0], "type", "veth", "peer", "name", veth[1],
                "netns", self.netns[1])
            for ns, dev, (name, addr) in zip(self.netns, veth, HOSTS):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                (self.tmp / f"{name}.hosts").write_text(f"127.0.0.1 localhost\n{addr} {name}\n")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.created:  # deleting a namespace deletes its end of the veth pair, and so both
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created.clear()

    def start(self, host: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Run ``argv`` on host 0 or 1: in its network namespace, with its host name and /etc/hosts."""
        name, _ = HOSTS[host]
        enter = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
        return _spawn(["ip", "netns", "exec", self.netns[host], "unshare", "--uts", "sh", "-c", enter, "sh",
                       str(self.tmp / f"{name}.hosts"), name, *argv], env)


@pytest.fixture
def two_hosts(tmp_path):
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(f"cross-host test not run: {reason}")
    try:
        hosts = TwoHosts(tmp_path).__enter__()
    except OSError as e:
        pytest.skip(f"cross-host test not run: cannot create network namespaces here ({e})")
    try:
        # The UTS and mount namespaces of each host (hostname, /etc/hosts) must work too.
        (rc, out), = _finish([hosts.start(1, ["hostname"], _clean_env())], 30)
        if rc != 0 or out.strip() != HOSTS[1][0]:
            pytest.skip(f"cross-host test not run: cannot give a namespace its own host name and "
                        f"/etc/hosts here (exit {rc}: {out.strip()[-300:]})")
        yield hosts
    finally:
        hosts.__exit__()
        assert not set(hosts.netns) & set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                         text=True).stdout.split()), "namespaces left behind"


def _on_two_hosts(hosts: TwoHosts, nprocs: tuple[int, int], script: list[str], F: int,
                  timeout_s: float = 50) -> list[tuple[int, str]]:
    """One torchrun agent per host, node rank 0 on the store host; ``[(exit code, output)]`` per host."""
    procs: list[subprocess.Popen] = []
    try:
        for node_rank in (0, 1):
            argv = _torchrun(node_rank, nprocs[node_rank], STORE_HOST, 29500, script)
            procs.append(hosts.start(node_rank, argv, _clean_env(AFD_NUM_FFN_RANKS=str(F))))
    except BaseException:
        _finish(procs, 0.1)
        raise
    return _finish(procs, timeout_s)


def _results(out_dir: Path) -> dict[int, dict]:
    return {int(Path(p).stem[4:]): json.loads(Path(p).read_text()) for p in glob.glob(str(out_dir / "rank*.json"))}


@pytest.mark.timeout(120)
def test_example_2a1f_across_two_hosts(two_hosts):
    # Host a: FFN rank 0 (torchrun rank 0, node rank 0, the store host). Host b: attention ranks 0 and 1.
    (rc_a, out_a), (rc_b, out_b) = _on_two_hosts(two_hosts, (1, 2), [EXAMPLE], F=1)
    assert rc_a == 0 and rc_b == 0, out_a + out_b
    got = {(m[0], int(m[1])): (m[2], int(m[3])) for m in EXAMPLE_LINE.findall(out_a + out_b)}
    assert got == {("ffn", 0): ("afd-host-a", 19), ("attention", 0): ("afd-host-b", 10),
                   ("attention", 1): ("afd-host-b", 9)}, out_a + out_b


@pytest.mark.timeout(120)
@pytest.mark.parametrize("A, F", [(2, 1), (2, 2)])
def test_steps_across_two_hosts_over_the_tcp_control_channel(two_hosts, tmp_path, A, F):
    import connector_scenarios as cs

    # Host a: the F FFN ranks (store host). Host b: the A attention ranks.
    (rc_a, out_a), (rc_b, out_b) = _on_two_hosts(two_hosts, (F, A), [WORKER, "steps", str(tmp_path)], F=F)
    assert rc_a == 0 and rc_b == 0, out_a + out_b
    res = _results(tmp_path)
    assert sorted(res) == list(range(A + F)), out_a + out_b
    for rank, r in res.items():
        role, rr = ("ffn", rank) if rank < F else ("attention", rank - F)
        assert (r["role"], r["role_rank"]) == (role, rr)
        assert r["host"] == ("afd-host-a" if role == "ffn" else "afd-host-b")
        assert (r["afd_host"], r["afd_port"]) == (STORE_HOST, 1239)  # from MASTER_ADDR; the default port
        senders = min(A, F)
        want = ["tcp"] * (senders and (role == "ffn" or rr < senders))  # auto picked TCP across hosts
        assert r["control"] == want, r
        assert "error" not in r, r
    sc = cs.Scenario(A=A, F=F, steps=cs.default_steps(A))
    assert any(len(step) == 2 for step in sc.steps) and any(0 in c for step in sc.steps for c in step.values())
    cs.check_scenario_results(sc, [res[r] for r in sorted(res)])


@pytest.mark.timeout(120)
def test_rank_killed_on_the_remote_host_is_a_named_error_on_the_store_host(two_hosts, tmp_path):
    # Host a (store host): FFN rank 0 and attention rank 0. Host b: attention rank 1, which dies mid-step.
    t0 = time.monotonic()
    (rc_a, out_a), (rc_b, out_b) = _on_two_hosts(two_hosts, (2, 1), [WORKER, "kill", str(tmp_path)], F=1)
    assert time.monotonic() - t0 < 50
    assert rc_b != 0 and rc_a != 0, out_a + out_b  # the victim died; the survivors re-raised their error
    res = _results(tmp_path)
    assert sorted(res) == [0, 1], out_a + out_b  # the victim wrote nothing
    ffn, a0 = res[0], res[1]
    assert (ffn["host"], a0["host"]) == ("afd-host-a", "afd-host-a")
    kind, msg = ffn["error"]
    assert kind == "AFDPeerError", ffn["error"]
    assert "waiting on attention rank 1 (world rank 2)" in msg and "layer 1" in msg and "stage 0" in msg, msg
    assert "waiting on attention rank 0" not in msg, msg
    # Attention rank 0 learns of it through FFN rank 0, which aborted the step: either the abort it
    # posted (naming attention rank 1) or its closed connection, whichever reaches it first.
    kind, msg = a0["error"]
    assert kind in ("StepAbortedError", "AFDPeerError"), a0["error"]
    assert "layer 1" in msg and "stage 0" in msg, msg
    assert ("attention rank 1" in msg) if kind == "StepAbortedError" else ("with FFN rank 0" in msg), msg


# ---------------------------------------------------------------------------
# Two torchrun agents on one host (no namespaces needed)
# ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_example_2a1f_as_two_local_nodes_afd_ext_launch_and_torchrun():
    from afd_ext.tools.testing import find_free_port

    afd_port, master_port = find_free_port(), find_free_port()
    # Node 0 through afd-ext launch (torchrun options passed through), node 1 through plain torchrun.
    node0 = [PY, "-m", "afd_ext", "launch", "-A", "2", "-F", "1", "--port", str(afd_port), "--nnodes", "2",
             "--node-rank", "0", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
             str(master_port), "--", PY, EXAMPLE]
    node1 = _torchrun(1, 2, "127.0.0.1", master_port, [EXAMPLE])
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_spawn(node0, _clean_env()))
        procs.append(_spawn(node1, _clean_env(AFD_NUM_FFN_RANKS="1", AFD_PORT=str(afd_port))))
    except BaseException:
        _finish(procs, 0.1)
        raise
    (rc0, out0), (rc1, out1) = _finish(procs, 50)
    assert rc0 == 0 and rc1 == 0, out0 + out1
    assert "[rank 0] multinode example: ffn rank 0" in out0, out0  # afd-ext launch's prefix
    got = {(m[0], int(m[1])): int(m[3]) for m in EXAMPLE_LINE.findall(out0)}
    assert got == {("ffn", 0): 19}, out0
    got = {(m[0], int(m[1])): int(m[3]) for m in EXAMPLE_LINE.findall(out1)}
    assert got == {("attention", 0): 10, ("attention", 1): 9}, out1
