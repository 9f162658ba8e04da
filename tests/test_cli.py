"""The first hour of a user (#32): the import's torch check, extras hints, one-line errors, Ctrl-C,
a busy port, the topology forms, no warnings, the docs' class names, the package metadata."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

import pytest

from afd_ext import errors
from afd_ext.tools import cli
from afd_ext.topology import rank_label

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_py(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
                          env=_env(), cwd=ROOT)


# ------------------------------------------------------------ the torch the core was built against
def test_a_core_built_against_another_torch_is_refused_before_it_loads():
    # The build's record says another torch; every way of loading the core stops with the named error,
    # and the library was never mapped into the process.
    r = _run_py("""
        import sys, types
        sys.modules["afd_ext._built_with"] = types.SimpleNamespace(TORCH_VERSION="2.11.0+cu130", TORCH_CUDA="13.0")
        import torch
        from afd_ext.errors import TorchMismatchError
        for how in ("import afd_ext.ops", "from afd_ext import _C"):
            try:
                exec(how)
            except TorchMismatchError as e:
                assert isinstance(e, ImportError)
                assert (e.built, e.installed) == ("2.11.0+cu130", torch.__version__), (e.built, e.installed)
                print("REFUSED", how, "|", e)
            else:
                raise SystemExit(how + " loaded the core")
        assert "afd_ext._C" not in sys.modules
        assert not any("/afd_ext/_C" in ln for ln in open("/proc/self/maps")), "the .so was mapped"
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("REFUSED")]
    assert len(lines) == 2
    import torch

    for ln in lines:
        assert "built against torch 2.11.0+cu130 (CUDA 13.0)" in ln
        assert f"but torch {torch.__version__}" in ln
        assert f"pip install --no-build-isolation -e {ROOT}" in ln  # a source tree: the exact rebuild command


def test_a_core_built_against_this_torch_loads():
    pytest.importorskip("afd_ext.ops", reason="afd_ext._C is not built")
    r = _run_py("""
        import sys, types, torch
        sys.modules["afd_ext._built_with"] = types.SimpleNamespace(TORCH_VERSION=torch.__version__,
                                                                   TORCH_CUDA=torch.version.cuda)
        import afd_ext.ops as ops
        from afd_ext._compat import built_with
        assert built_with() == {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
        print("LOADED", ops.is_cuda_built() in (True, False))
    """)
    assert r.returncode == 0 and "LOADED True" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("floor, core_cuda, loads", [("2.11", None, True), ("99.0", None, False),
                                                     ("2.11", "cuda-major", True), ("2.11", "other-major", False)])
def test_a_stable_abi_core_loads_under_any_torch_from_its_floor(floor, core_cuda, loads):
    # A stable-ABI build's record: any torch >= STABLE_ABI, of the CUDA major of the core's kernels.
    pytest.importorskip("afd_ext.ops", reason="afd_ext._C is not built")
    r = _run_py(f"""
        import sys, types, torch
        cuda = {{"cuda-major": torch.version.cuda, "other-major": "1.0"}}.get({core_cuda!r})
        sys.modules["afd_ext._built_with"] = types.SimpleNamespace(TORCH_VERSION="2.11.0+cu130", TORCH_CUDA="13.0",
                                                                   STABLE_ABI={floor!r}, CORE_CUDA=cuda)
        from afd_ext.errors import TorchMismatchError
        try:
            from afd_ext import _compat
            _compat.check_torch()
            print("LOADED")
        except TorchMismatchError as e:
            print("REFUSED", e)
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    import torch

    loads = loads and not (core_cuda == "cuda-major" and torch.version.cuda is None)  # a CPU torch: no CUDA
    assert ("LOADED" in r.stdout) == loads, r.stdout
    if not loads:
        assert "stable ABI" in r.stdout and ("torch >= 99.0" in r.stdout or "CUDA 1.0 kernels" in r.stdout)


def test_setup_records_the_torch_it_builds_against(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("afd_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "_built_with.py"
    mod.write_torch_record("2.13.0+cpu", None, path=path)
    ns: dict = {}
    exec(path.read_text(), ns)
    assert (ns["TORCH_VERSION"], ns["TORCH_CUDA"], ns["CORE_CUDA"]) == ("2.13.0+cpu", None, None)
    assert ns["STABLE_ABI"] == "2.11"  # setup.py's TORCH_TARGET_VERSION, the package's torch floor
    mod.write_torch_record("2.14.1+cu130", "13.0", True, path=path)
    exec(path.read_text(), ns)
    assert (ns["TORCH_VERSION"], ns["TORCH_CUDA"], ns["CORE_CUDA"]) == ("2.14.1+cu130", "13.0", "13.0")
    # The build writes it before setup() collects the package's modules, and git ignores it.
    assert "write_torch_record(torch.__version__, torch.version.cuda, use_cuda)" in (ROOT / "setup.py").read_text()
    assert "/afd_ext/_built_with.py" in (ROOT / ".gitignore").read_text()


# ------------------------------------------------------------------------ extras
def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_extras_table_matches_pyproject():
    extras = _pyproject()["project"]["optional-dependencies"]
    for command, (extra, modules) in cli.EXTRAS.items():
        names = {re.match(r"[A-Za-z0-9_.-]+", req)[0] for req in extras[extra]}
        assert set(modules) == names, (command, extra)


@pytest.mark.parametrize("command,module,extra", [("demo", "transformers", "demo"), ("demo", "tqdm", "demo"),
                                                  ("bench", "matplotlib", "bench")])
def test_a_missing_extra_is_a_one_line_hint_before_any_work(monkeypatch, capsys, command, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # find_spec() -> None: as if not installed

    def no_work(name):
        raise AssertionError(f"{name} started although its extra is missing")

    monkeypatch.setattr(cli, "_resolve", no_work)
    assert cli.main([command]) == 1
    err = capsys.readouterr().err
    assert err == f"afd-ext {command} needs {module} (the '{extra}' extra): pip install 'afd_ext[{extra}]'\n"


def test_an_extra_module_the_options_do_not_use_is_not_required(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert cli.missing_extra("bench", ["--no-plot", "--no-progress"]) is None
    assert cli.missing_extra("bench", ["--check", "--no-progress"]) is None
    assert cli.missing_extra("bench", ["--no-progress"]) == (
        "afd-ext bench needs matplotlib (the 'bench' extra): pip install 'afd_ext[bench]'")
    assert "needs tqdm" in cli.missing_extra("demo", [])
    assert cli.missing_extra("launch", []) is None


def test_help_works_without_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out


# ------------------------------------------------------------- one-line errors, Ctrl-C
def _worker_traceback() -> str:
    """The text a failed worker sends (run_workers' _entry: traceback.format_exc()), with a chained cause."""
    def inner():
        raise ConnectionResetError("socket closed")

    def outer():
        try:
            inner()
        except ConnectionResetError as e:
            raise errors.AFDPeerError("recv_ffn_output: FFN rank 0 (world rank 0) closed its end\n"
                                      "second line of the message") from e
    try:
        outer()
    except errors.AFDPeerError:
        return traceback.format_exc()
    raise AssertionError("unreachable")


def test_errors_are_one_line_with_the_class_and_exit_1(monkeypatch, capsys):
    pytest.importorskip("transformers")
    from afd_ext.tools import demo
    from afd_ext.tools.testing import WorkerError

    def timeout(plan, timeout_s):
        raise errors.AFDTimeoutError("send_attn_output on attention rank 0 at step 3\nmore detail")

    monkeypatch.setattr(demo, "run_demo", timeout)
    argv = ["demo", "--dims", "tiny", "--backend", "gloo", "--no-progress"]
    assert cli.main(argv) == 1
    assert capsys.readouterr().err == "afd-ext demo: AFDTimeoutError: send_attn_output on attention rank 0 at step 3\n"

    def worker_failed(plan, timeout_s):
        e = WorkerError(2, _worker_traceback())
        e.label = rank_label(2, plan.num_ffn)  # as run_demo names it
        raise e

    monkeypatch.setattr(demo, "run_demo", worker_failed)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err == ("afd-ext demo: AFDPeerError in attention rank 1 (world rank 2): recv_ffn_output: FFN rank 0 "
                   "(world rank 0) closed its end\n")
    # -v: the traceback, the worker's included, then the same line.
    assert cli.main([*argv, "-v"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ConnectionResetError: socket closed" in err
    assert err.endswith("afd-ext demo: AFDPeerError in attention rank 1 (world rank 2): recv_ffn_output: "
                        "FFN rank 0 (world rank 0) closed its end\n")


def test_error_line_without_a_message_and_for_plain_exceptions():
    assert cli.error_line("bench", RuntimeError()) == "afd-ext bench: RuntimeError"
    assert cli.error_line("launch", OSError("disk full")) == "afd-ext launch: OSError: disk full"


def test_ctrl_c_is_one_line_and_130(monkeypatch, capsys):
    pytest.importorskip("transformers")
    from afd_ext.tools import demo

    def interrupted(plan, timeout_s):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_demo", interrupted)
    assert cli.main(["demo", "--dims", "tiny", "--backend", "gloo", "--no-progress"]) == 130
    assert capsys.readouterr().err == "afd-ext demo: interrupted\n"


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _ignores_sigint(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigIgn:"))
    except (OSError, StopIteration):
        return False
    return bool(mask & (1 << (signal.SIGINT - 1)))


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
@pytest.mark.timeout(120)
def test_ctrl_c_in_a_running_demo_exits_130_quietly():
    """Ctrl-C reaches the whole process group (a terminal): the demo stops every process, prints one line."""
    pytest.importorskip("transformers")
    pytest.importorskip("afd_ext.connector")
    p = subprocess.Popen([PY, "-m", "afd_ext", "demo", "--dims", "tiny", "--backend", "gloo", "--topology", "1A1F",
                          "--max-new-tokens", "16", "--requests-per-rank", "3", "--step-timeout", "60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                         start_new_session=True,
                         # A terminal's Ctrl-C: the default disposition, even where this run inherited SIGINT
                         # ignored (a job started with `&` by a shell without job control ignores it, as nohup runs do)
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        # Both workers and the resource tracker are up and have set their SIGINT disposition.
        while time.monotonic() < deadline:
            kids = _children(p.pid)
            if len(kids) >= 3 and all(_ignores_sigint(k) for k in kids):
                break
            assert p.poll() is None, p.communicate()
            time.sleep(0.05)
        else:
            pytest.fail(f"the demo's processes did not start: {_children(p.pid)}")
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, f"stderr {err!r}; stdout {out[-800:]!r}"  # a demo run to its end says so on stdout
    assert err == "afd-ext demo: interrupted\n", err
    assert out == ""


# ------------------------------------------------------------------- a busy port
@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_a_busy_port_is_named_within_a_second(busy_port, capsys):
    pytest.importorskip("transformers")
    t0 = time.monotonic()
    rc = cli.main(["demo", "--dims", "tiny", "--backend", "gloo", "--no-progress", "--port", str(busy_port)])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2 and took < 1.0, (rc, took, err)
    assert err == (f"afd-ext demo: RendezvousError: FFN rank 0 cannot bind the AFD rendezvous store to "
                   f"127.0.0.1:{busy_port}: port {busy_port} is already in use on '127.0.0.1'; pick another port "
                   "(another AFD job or a stale process may hold it)\n")


def test_launch_names_a_busy_port_before_torch_starts(busy_port):
    t0 = time.monotonic()
    r = subprocess.run([PY, "-m", "afd_ext", "launch", "-A", "1", "-F", "1", "--port", str(busy_port), "--", "true"],
                       capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and f"port {busy_port} is already in use" in r.stderr
    assert r.stderr.startswith("afd-ext launch: RendezvousError: ")
    assert took < 5.0  # interpreter start included; torch is never imported (its import alone takes longer)


@pytest.mark.parametrize("nnodes", ["2", "1:4"])
def test_launch_on_several_nodes_leaves_the_port_to_ffn_rank_0s_host(busy_port, monkeypatch, nnodes):
    """The AFD store is bound on FFN rank 0's node, maybe another host: no bind check here, and torchrun gets
    --nnodes as given (an abbreviation of it is refused, not read as a second --nnodes)."""
    from torch.distributed import run as torchrun

    from afd_ext.tools import launch

    ran = []
    monkeypatch.setattr(torchrun, "run", ran.append)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # main() exports the AFD variables
    assert launch.main(["-A", "1", "-F", "1", f"--nnodes={nnodes}", "--port", str(busy_port), "--", "true"]) == 0
    assert ran[0].nnodes == nnodes and os.environ["AFD_PORT"] == str(busy_port) and "AFD_HOST" not in os.environ
    with pytest.raises(SystemExit) as e:
        launch.main(["-A", "1", "-F", "1", "--nnode", "2", "--", "true"])
    assert e.value.code == 2


# ---------------------------------------------------------------------- topology
def test_topology_accepts_every_form_its_help_shows():
    pytest.importorskip("transformers")
    from afd_ext.tools import demo

    for text, want in [("2A1F", (2, 1)), ("2a1f", (2, 1)), ("2x1", (2, 1)), ("2X1", (2, 1)), ("2:1", (2, 1)),
                       (" 3 : 2 ", (3, 2)), ("12A3F", (12, 3))]:
        assert demo.parse_topology(text) == want, text
        assert demo.parse_args(["--topology", text]).topology == want
    for bad in ("2-1", "0x1", "2A0F", "2A", "A1F", "", "2x1x1", "2F1A"):
        with pytest.raises(errors.AFDConfigError):
            demo.parse_topology(bad)
    p_help = subprocess.run([PY, "-m", "afd_ext", "demo", "--help"], capture_output=True, text=True, timeout=60,
                            env=_env(), cwd=ROOT).stdout
    topo = " ".join(p_help.rsplit("--topology", 1)[1].split("--backend", 1)[0].split())  # its options entry
    shown = re.findall(r"\b\d+A\d+F\b|\b\d+x\d+\b|\b\d+:\d+\b", topo)
    assert {"2A1F", "2x1", "2:1"} <= set(shown), topo
    for form in shown:
        demo.parse_topology(form)


# ----------------------------------------------------------------- the progress bar
class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_ends_its_own_line_at_the_steps_run():
    pytest.importorskip("tqdm")
    pytest.importorskip("transformers")
    import threading

    from tqdm import tqdm

    from afd_ext.tools import demo

    assert demo._progress_bar(8, io.StringIO()) is None  # not a terminal: no bar (no \r frames in logs)
    stream = _TTY()
    bar = demo._progress_bar(8, stream)
    for _ in range(5):  # max_steps is an upper bound: fewer steps ran
        bar.update(1)
    demo._finish_bar(bar)
    text = stream.getvalue()
    assert text.endswith("\n")  # the summary that follows starts on its own line
    assert "5/5" in text.rsplit("\r", 1)[-1]
    # A thread lock: no multiprocessing semaphore for the resource tracker to report at exit.
    assert type(tqdm.get_lock()).__name__ != "TqdmDefaultWriteLock"
    assert isinstance(tqdm.get_lock(), type(threading.RLock()))


def test_a_worker_with_the_bar_leaves_no_semaphore(tmp_path):
    pytest.importorskip("tqdm")
    pytest.importorskip("transformers")
    script = tmp_path / "bar_worker.py"
    script.write_text(textwrap.dedent("""
        import io
        from afd_ext.tools import demo
        from afd_ext.tools.testing import run_workers

        class TTY(io.StringIO):
            def isatty(self):
                return True

        def work(rank, nprocs):
            bar = demo._progress_bar(5, TTY())
            for _ in range(5):
                bar.update(1)
            demo._finish_bar(bar)
            return bar.n

        if __name__ == "__main__":
            print("RESULT", run_workers(work, 2, timeout_s=60))
    """))
    r = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert r.returncode == 0 and "RESULT [5, 5]" in r.stdout, r.stderr
    assert "leaked semaphore" not in r.stderr and "Warning" not in r.stderr, r.stderr


# ---------------------------------------------------------------- the one-GPU note
def test_one_gpu_note_names_the_backends_data_path():
    pytest.importorskip("transformers")
    from afd_ext.tools import demo
    from afd_ext.tools.testing import place_processes

    placement = place_processes(2, 1, 1)  # one GPU: every process on GPU 0
    assert placement.shared and placement.nccl_hostids
    args = demo.parse_args(["--dims", "tiny", "--backend", "gloo", "--no-progress"])
    for backend, says, never in (("peer", "peer memory (CUDA IPC)", "NCCL"), ("nccl", "NCCL goes over sockets", "IPC")):
        plan = demo.build_plan(args)
        plan = demo.dataclasses.replace(plan, backend=backend, gpu_placement=placement)
        res = demo.RankResult(rank=0, requests=[], step_counts=[[1, 1]], wall_s=0.1, latency_ns={0: [1000, 1000]},
                              bytes_sent=10, bytes_received=10, steps=2)
        ck = demo.CheckResult(ok=True, tolerance=1e-4, max_abs_diff=0.0, positions=2, worst="-", failures=[])
        text = demo.format_summary(demo.summarize(plan, [res], [{"rank": 0, "rows": 2}], ck, 1.0))
        note = next(ln for ln in text.splitlines() if ln.strip().startswith("NOTE"))
        place = next(ln for ln in text.splitlines() if ln.strip().startswith("placement"))
        assert says in note and never not in note, note
        if backend == "peer":
            assert "NCCL" not in place and "peer memory (CUDA IPC)" in place, place
        else:
            assert "NCCL over sockets" in place, place


# ------------------------------------------------------------------ docs, metadata
def test_troubleshooting_names_the_printed_class_names():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    named = set(re.findall(r"`([A-Z][A-Za-z]*(?:Error|Closed|Timeout))\b", text))
    ours = {n for n in named if hasattr(errors, n)}
    assert {"AFDStateError", "AFDClosedError", "TorchMismatchError", "ControlChannelClosed"} <= ours
    # An alias prints as the class it aliases: the docs must name that one (the older name only as "alias").
    aliases = {n for n in ours if getattr(errors, n).__name__ != n}
    mentioned_as_alias = set(re.findall(r"aliases such as\s+`(\w+)`", text))
    assert aliases <= mentioned_as_alias, aliases - mentioned_as_alias
    import builtins

    for n in named - ours:  # the rest are builtins
        assert hasattr(builtins, n), n


def test_pyproject_license_and_urls_load_without_warnings():
    data = _pyproject()["project"]
    assert data["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert set(data["urls"]) == {"Homepage", "Repository", "Documentation", "Issues"}
    assert all(u.startswith("https://") for u in data["urls"].values())
    assert not any("<" in dep for dep in data["dependencies"] if dep.startswith("torch"))  # no upper bound
    r = _run_py("""
        import warnings
        warnings.simplefilter("error")
        from setuptools.config import pyprojecttoml
        from setuptools.dist import Distribution
        d = Distribution()
        pyprojecttoml.apply_configuration(d, "pyproject.toml")
        print("LICENSE", d.metadata.license_expression)
    """)
    assert r.returncode == 0 and "LICENSE Apache-2.0" in r.stdout, r.stderr
