"""``afd-ext launch``: start ``A`` attention and ``F`` FFN processes on this host.

Usage::

    afd-ext launch --num-attention-ranks 2 --num-ffn-ranks 1 \\
        [--host 127.0.0.1] [--port 29600] [--attention-gpus 0,0 --ffn-gpus 1] \\
        [--extra-config '{"transport": "gloo"}'] -- python my_script.py --my-args

Every process gets, in the AFD world order (FFN ranks first: world rank = role
rank for FFN rank ``f``, ``F + a`` for attention rank ``a``):

=============================  ==============================================
``AFD_ROLE``                   ``attention`` or ``ffn``
``AFD_ROLE_RANK``              rank inside the role
``AFD_NUM_ATTENTION_RANKS``    ``A``
``AFD_NUM_FFN_RANKS``          ``F``
``AFD_HOST`` / ``AFD_PORT``    the rendezvous address (FFN rank 0 hosts the store)
``AFD_CONNECTOR_EXTRA_CONFIG``  ``--extra-config`` (JSON), when given
``CUDA_VISIBLE_DEVICES``       the process's GPU from ``--attention-gpus`` /
                               ``--ffn-gpus`` (when given), and then
``AFD_DEVICE=0``
``RANK`` / ``WORLD_SIZE``      torchrun-compatible: the AFD world rank and ``A + F``
``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE``           as torchrun on one node: ``RANK`` and ``A + F``
``MASTER_ADDR`` /
``MASTER_PORT``                ``--host`` and a second free port (not
                               ``AFD_PORT``), for a script's own
                               ``torch.distributed`` default group
=============================  ==============================================

Note ``LOCAL_RANK`` keeps torchrun's meaning (process index on the node); with
``--*-gpus`` each process sees one GPU, so use ``AFD_DEVICE`` (or
:func:`local_device`) for the device index, not ``LOCAL_RANK``.

Each output line is prefixed with ``[attn 0]`` / ``[ffn 0]``. When a process
exits non-zero, the launcher terminates the others (SIGTERM, then SIGKILL
after ``--grace-s``) and returns that exit code (``128 + signal`` for a
process killed by a signal); on Ctrl-C it forwards SIGINT, then terminates,
and returns 130. Each child runs in its own process group, so its own
children are terminated with it.

Inside the script, :func:`config_from_env` returns ``(role, role_rank,
AFDConfig)`` built from these variables.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, NamedTuple, Sequence

logger = logging.getLogger(__name__)

__all__ = ["main", "build_parser", "process_env", "config_from_env", "local_device", "LaunchedRank"]


class LaunchedRank(NamedTuple):
    """What :func:`config_from_env` returns: ``(role, role_rank, config)``."""

    role: str
    role_rank: int
    config: "object"  # afd_ext.config.AFDConfig


def _gpu_list(text: str, n: int, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or any(not t.isdigit() for t in items):
        raise argparse.ArgumentTypeError(f"{flag} must be a comma-separated list of GPU indices, got {text!r}")
    if len(items) == 1:
        return items * n
    if len(items) != n:
        raise argparse.ArgumentTypeError(
            f"{flag} has {len(items)} entries, expected 1 (shared by all) or {n} (one per rank)")
    return items


def build_parser() -> argparse.ArgumentParser:
    """The ``afd-ext launch`` argument parser."""
    p = argparse.ArgumentParser(
        prog="afd-ext launch",
        description="Start A attention and F FFN processes on this host with the AFD_* and "
                    "torchrun-compatible environment variables set.",
        epilog="Example: afd-ext launch --num-attention-ranks 2 --num-ffn-ranks 1 -- python script.py",
    )
    p.add_argument("--num-attention-ranks", "-A", type=int, required=True, help="A >= 1")
    p.add_argument("--num-ffn-ranks", "-F", type=int, required=True, help="F >= 1")
    p.add_argument("--host", default="127.0.0.1",
                   help="rendezvous host: an address of this machine (FFN rank 0 runs here). Default 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free port)")
    p.add_argument("--master-port", type=int, default=None,
                   help="MASTER_PORT for the script's own torch.distributed group (default: a free port)")
    p.add_argument("--attention-gpus", default=None,
                   help="GPU per attention rank, e.g. '0,0' (one entry: all share it). Sets CUDA_VISIBLE_DEVICES")
    p.add_argument("--ffn-gpus", default=None, help="GPU per FFN rank, e.g. '1'")
    p.add_argument("--extra-config", default=None,
                   help="JSON object passed as AFD_CONNECTOR_EXTRA_CONFIG (connector_extra_config)")
    p.add_argument("--grace-s", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the others (default 5)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the role/rank")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the command to run in every process, after '--'")
    return p


def process_env(
    role: str,
    role_rank: int,
    num_attention_ranks: int,
    num_ffn_ranks: int,
    host: str,
    port: int,
    master_port: int,
    gpu: str | None = None,
    extra_config: str | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one launched process (see the module doc for every variable).

    Args:
        role: ``"attention"`` or ``"ffn"``; role_rank: rank inside the role.
        num_attention_ranks, num_ffn_ranks: ``A`` and ``F``.
        host, port: the rendezvous address; master_port: ``MASTER_PORT``.
        gpu: GPU index for ``CUDA_VISIBLE_DEVICES`` (None: inherit).
        extra_config: JSON for ``AFD_CONNECTOR_EXTRA_CONFIG`` (None: unset).
        base: starting environment (default ``os.environ``).

    Returns:
        The full environment mapping.
    """
    env = dict(os.environ if base is None else base)
    world_size = num_attention_ranks + num_ffn_ranks
    world_rank = role_rank if role == "ffn" else num_ffn_ranks + role_rank
    env.update({
        "AFD_ROLE": role,
        "AFD_ROLE_RANK": str(role_rank),
        "AFD_NUM_ATTENTION_RANKS": str(num_attention_ranks),
        "AFD_NUM_FFN_RANKS": str(num_ffn_ranks),
        "AFD_HOST": host,
        "AFD_PORT": str(port),
        "RANK": str(world_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(world_rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(master_port),
        "PYTHONUNBUFFERED": "1",
    })
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
        env["AFD_DEVICE"] = "0"
    if extra_config is not None:
        env["AFD_CONNECTOR_EXTRA_CONFIG"] = extra_config
    return env


def _pump(stream: IO[bytes], prefix: bytes, out, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if prefix else line)
            if not line.endswith(b"\n"):
                out.write(b"\n")
            out.flush()
    stream.close()


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child leads its own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_all(procs: list[tuple[str, subprocess.Popen]], grace_s: float, first: int = signal.SIGTERM) -> None:
    for _, p in procs:
        if p.poll() is None:
            _signal_group(p, first)
    deadline = time.monotonic() + grace_s
    for _, p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for name, p in procs:
        if p.poll() is None:
            logger.warning("afd-ext launch: %s did not stop within %.1f s; killing it", name, grace_s)
            _signal_group(p, signal.SIGKILL)
            p.wait(timeout=10)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``afd-ext launch``; returns the exit code (0, the first failing rank's code, or 130).

    Raises:
        SystemExit: bad arguments (argparse, exit code 2).
    """
    from afd_ext.testing import find_free_port

    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("give the command to run after '--', e.g. -- python script.py")
    A, F = args.num_attention_ranks, args.num_ffn_ranks
    if A < 1 or F < 1:
        parser.error(f"--num-attention-ranks and --num-ffn-ranks must be >= 1, got {A} and {F}")
    try:
        attn_gpus = _gpu_list(args.attention_gpus, A, "--attention-gpus") if args.attention_gpus else [None] * A
        ffn_gpus = _gpu_list(args.ffn_gpus, F, "--ffn-gpus") if args.ffn_gpus else [None] * F
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    if args.extra_config is not None:
        try:
            if not isinstance(json.loads(args.extra_config), dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            parser.error(f"--extra-config must be a JSON object: {e}")
    port = args.port if args.port is not None else find_free_port(args.host)
    master_port = args.master_port if args.master_port is not None else find_free_port(args.host)
    if master_port == port:
        parser.error("--master-port must differ from --port")
    if not 0 < port < 65536:
        parser.error(f"--port must be in 1..65535, got {port}")

    # FFN rank 0 first: it hosts the rendezvous store.
    ranks = [("ffn", f, ffn_gpus[f]) for f in range(F)] + [("attention", a, attn_gpus[a]) for a in range(A)]
    out = sys.stdout.buffer
    lock = threading.Lock()
    procs: list[tuple[str, subprocess.Popen]] = []
    pumps: list[threading.Thread] = []
    print(f"afd-ext launch: {A} attention + {F} FFN ranks, rendezvous {args.host}:{port}", file=sys.stderr,
          flush=True)
    exit_code = 0
    try:
        for role, rr, gpu in ranks:
            name = f"{'attn' if role == 'attention' else 'ffn'} {rr}"
            env = process_env(role, rr, A, F, args.host, port, master_port, gpu, args.extra_config)
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append((name, p))
            prefix = b"" if args.no_prefix else f"[{name}] ".encode()
            t = threading.Thread(target=_pump, args=(p.stdout, prefix, out, lock), daemon=True)
            t.start()
            pumps.append(t)
        while True:
            running = 0
            for name, p in procs:
                rc = p.poll()
                if rc is None:
                    running += 1
                elif rc != 0:
                    exit_code = _exit_code(rc)
                    print(f"afd-ext launch: {name} exited with code {exit_code}; stopping the other ranks",
                          file=sys.stderr, flush=True)
                    raise _Stop
            if running == 0:
                break
            time.sleep(0.05)
    except _Stop:
        _stop_all(procs, args.grace_s)
    except KeyboardInterrupt:
        print("afd-ext launch: interrupted; stopping every rank", file=sys.stderr, flush=True)
        _stop_all(procs, args.grace_s, first=signal.SIGINT)
        exit_code = 130
    except BaseException:
        _stop_all(procs, args.grace_s)
        raise
    for t in pumps:
        t.join(timeout=5)
    return exit_code


class _Stop(Exception):
    pass


def local_device() -> int | None:
    """The CUDA device index this launched process should use (``AFD_DEVICE``), or None if unset."""
    from afd_ext import envs

    return envs.get("AFD_DEVICE")


def config_from_env(**overrides) -> LaunchedRank:
    """Build ``(role, role_rank, AFDConfig)`` from the variables ``afd-ext launch`` sets.

    Args:
        **overrides: AFDConfig fields that win over the environment (e.g.
            ``connector_extra_config={...}``, merged over ``AFD_CONNECTOR_EXTRA_CONFIG``).

    Returns:
        :class:`LaunchedRank` ``(role, role_rank, config)``.

    Raises:
        RuntimeError: a required variable is missing (not started by ``afd-ext launch``
            or an equivalent launcher); the message names it.
        ValueError: a variable does not parse, or the role rank is out of range.
    """
    from afd_ext import envs
    from afd_ext.config import AFDConfig

    values = {}
    for name in ("AFD_ROLE", "AFD_ROLE_RANK", "AFD_NUM_ATTENTION_RANKS", "AFD_NUM_FFN_RANKS",
                 "AFD_HOST", "AFD_PORT"):
        v = envs.get(name)
        if v is None:
            raise RuntimeError(
                f"{name} is not set: start this script with `afd-ext launch ... -- python script.py` "
                "or set AFD_ROLE, AFD_ROLE_RANK, AFD_NUM_ATTENTION_RANKS, AFD_NUM_FFN_RANKS, AFD_HOST, AFD_PORT"
            )
        values[name] = v
    extra: dict = {}
    raw_extra = envs.get("AFD_CONNECTOR_EXTRA_CONFIG")
    if raw_extra:
        try:
            extra = json.loads(raw_extra)
        except ValueError as e:
            raise ValueError(f"AFD_CONNECTOR_EXTRA_CONFIG is not valid JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("AFD_CONNECTOR_EXTRA_CONFIG must be a JSON object")
    extra.update(overrides.pop("connector_extra_config", None) or {})
    role, role_rank = values["AFD_ROLE"], values["AFD_ROLE_RANK"]
    cfg = AFDConfig(**{
        "role": role,
        "host": values["AFD_HOST"],
        "port": values["AFD_PORT"],
        "num_attention_ranks": values["AFD_NUM_ATTENTION_RANKS"],
        "num_ffn_ranks": values["AFD_NUM_FFN_RANKS"],
        "connector_extra_config": extra,
        **overrides,
    })
    limit = cfg.num_attention_ranks if role == "attention" else cfg.num_ffn_ranks
    if not 0 <= role_rank < limit:
        raise ValueError(f"AFD_ROLE_RANK={role_rank} is out of range for {limit} {role} ranks")
    return LaunchedRank(role, role_rank, cfg)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
