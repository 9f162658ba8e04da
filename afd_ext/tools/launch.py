"""Start AFD ranks with torchrun, on one host or several, and tell each process who it is.

Two halves:

* :func:`config_from_env`, called inside a rank: ``(role, role_rank,
  AFDConfig)`` from the environment its launcher set (torchrun, ``afd-ext
  launch``, a job scheduler), by the rules below.
* ``afd-ext launch`` (:func:`main`): ``torchrun`` with the AFD variables
  exported, ``--nproc-per-node`` defaulting to ``A + F`` and each output line
  prefixed with the rank. It is a thin layer: signals (SIGTERM and Ctrl-C stop
  every rank), stopping the others when one rank fails, and several nodes
  (``--nnodes``/``--node-rank``/``--master-addr``) are torchrun's own, so there
  is one launcher to trust. Multi-node use: ``docs/multi-node.md``.

Which rank is which
-------------------
``A`` and ``F`` come from ``AFD_NUM_ATTENTION_RANKS`` / ``AFD_NUM_FFN_RANKS``;
under torchrun one of them is enough (the other is ``WORLD_SIZE`` minus it).
The role and role rank, first rule that applies:

1. ``AFD_ROLE`` and ``AFD_ROLE_RANK``: set per process (a launcher of your own).
2. ``AFD_ROLES`` and torchrun's ``RANK``: an explicit mapping, the role of each
   launcher rank in order (``"ffn,attention,attention"``, or ``"f,a,a"``);
   role ranks count up in that order.
3. torchrun's ``RANK`` in the AFD world order, FFN ranks first: rank ``r < F``
   is FFN rank ``r``, rank ``r >= F`` is attention rank ``r - F``.

Under 2 and 3 ``WORLD_SIZE`` must equal ``A + F``.

The rendezvous address: ``host`` is ``AFD_HOST``, else torchrun's
``MASTER_ADDR`` when FFN rank 0 is launcher rank 0 (rule 3 always puts it
there; with a static rendezvous that is node rank 0, the ``--master-addr``
host). ``port`` is ``AFD_PORT``, else the configuration's default (1239): the
AFD store listens on its own port, never torchrun's ``MASTER_PORT``.

``afd-ext launch`` exports ``AFD_NUM_ATTENTION_RANKS``, ``AFD_NUM_FFN_RANKS``,
``AFD_HOST`` and ``AFD_PORT`` (on one node: ``--host`` default 127.0.0.1 and a
free port; on several nodes only what you give), ``AFD_CONNECTOR_EXTRA_CONFIG``
(``--extra-config``) and ``AFD_ATTENTION_GPUS`` / ``AFD_FFN_GPUS``
(``--attention-gpus`` / ``--ffn-gpus``, read by :func:`local_device`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import TYPE_CHECKING, NamedTuple, Sequence

from afd_ext import envs
from afd_ext.errors import AFDConfigError, AFDError
from afd_ext.tools.cli import ranged

if TYPE_CHECKING:
    from afd_ext.config import AFDConfig

_ROLE_NAMES = {"a": "attention", "attention": "attention", "f": "ffn", "ffn": "ffn"}


class LaunchedRank(NamedTuple):
    """What :func:`config_from_env` returns: ``(role, role_rank, config)``."""

    role: str
    role_rank: int
    config: "AFDConfig"


# ---------------------------------------------------------------------------
# Inside a rank: who am I
# ---------------------------------------------------------------------------


def _launcher_int(name: str) -> int | None:
    """torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` as an int >= 0, or None when unset."""
    raw = os.environ.get(name)
    if raw is not None and not raw.strip().isdigit():
        raise AFDConfigError(f"environment variable {name}={raw!r} is not an int >= 0")
    return None if raw is None else int(raw)


def _parse_roles(text: str) -> list[str]:
    roles = [_ROLE_NAMES.get(t.strip().lower()) for t in text.split(",")]
    if not roles or None in roles:
        raise AFDConfigError(
            f"AFD_ROLES={text!r}: give the role of each launcher rank in order, comma-separated "
            "'attention'/'ffn' (or 'a'/'f'), e.g. 'ffn,attention,attention'")
    return roles  # type: ignore[return-value]


def _counts(attention: int | None, ffn: int | None, world: int | None) -> tuple[int, int]:
    if attention is None and ffn is None:
        raise AFDConfigError(
            "AFD_NUM_ATTENTION_RANKS and AFD_NUM_FFN_RANKS are not set: set both (or one of them "
            "under torchrun, which gives WORLD_SIZE), or pass num_attention_ranks/num_ffn_ranks")
    if attention is None or ffn is None:
        known, name = (ffn, "AFD_NUM_ATTENTION_RANKS") if attention is None else (attention, "AFD_NUM_FFN_RANKS")
        if world is None:
            raise AFDConfigError(f"{name} is not set, and there is no WORLD_SIZE to derive it from")
        if world - known < 1:
            raise AFDConfigError(f"WORLD_SIZE={world} leaves no rank for {name} (the other role has {known})")
        attention, ffn = (world - known, known) if attention is None else (known, world - known)
    return int(attention), int(ffn)


def resolve_role(num_attention_ranks: int, num_ffn_ranks: int, *, rank: int | None = None,
                 world_size: int | None = None) -> tuple[str, int, bool]:
    """This process's ``(role, role_rank, ffn0_is_rank0)`` from the environment (module doc rules 1-3).

    Args:
        num_attention_ranks, num_ffn_ranks: ``A`` and ``F``.
        rank, world_size: the launcher rank and world size (default: ``RANK``,
            ``WORLD_SIZE`` from the environment).

    Returns:
        The role (``"attention"``/``"ffn"``), the rank inside it, and whether
        FFN rank 0 is launcher rank 0 (so torchrun's ``MASTER_ADDR`` is its host).

    Raises:
        AFDConfigError: a variable is missing or bad, ``WORLD_SIZE != A + F``,
            or the role rank is out of range; the message names the variable.
    """
    A, F = num_attention_ranks, num_ffn_ranks
    role = envs.get("AFD_ROLE")
    if role is not None:
        if role not in ("attention", "ffn"):
            raise AFDConfigError(f"AFD_ROLE={role!r}: expected 'attention' or 'ffn'")
        role_rank = envs.get("AFD_ROLE_RANK")
        if role_rank is None:
            raise AFDConfigError("AFD_ROLE is set but AFD_ROLE_RANK is not: set both, or neither under torchrun")
        ffn0_is_rank0 = False
    else:
        rank = _launcher_int("RANK") if rank is None else rank
        world = _launcher_int("WORLD_SIZE") if world_size is None else world_size
        if rank is None or world is None:
            raise AFDConfigError(
                "no role for this process: start it with torchrun or `afd-ext launch` (RANK, WORLD_SIZE), "
                "or set AFD_ROLE and AFD_ROLE_RANK")
        if world != A + F:
            raise AFDConfigError(
                f"WORLD_SIZE={world} but A + F = {A} + {F} = {A + F}: start exactly A + F processes "
                "(torchrun --nproc-per-node on each node, summed over the nodes)")
        if rank >= world:
            raise AFDConfigError(f"RANK={rank} is out of range for WORLD_SIZE={world}")
        mapping = envs.get("AFD_ROLES")
        if mapping is not None:
            roles = _parse_roles(mapping)
            if len(roles) != world or roles.count("ffn") != F:
                raise AFDConfigError(
                    f"AFD_ROLES={mapping!r} lists {len(roles)} ranks ({roles.count('ffn')} FFN); "
                    f"expected WORLD_SIZE={world} with F={F} FFN ranks")
            role = roles[rank]
            role_rank = roles[:rank].count(role)
            ffn0_is_rank0 = roles[0] == "ffn"
        else:
            role, role_rank = ("ffn", rank) if rank < F else ("attention", rank - F)
            ffn0_is_rank0 = True
    limit = A if role == "attention" else F
    if not 0 <= role_rank < limit:
        raise AFDConfigError(f"AFD_ROLE_RANK={role_rank} is out of range for {limit} {role} ranks")
    return role, role_rank, ffn0_is_rank0


def config_from_env(**overrides) -> LaunchedRank:
    """Build ``(role, role_rank, AFDConfig)`` from the launcher's environment (module doc).

    Args:
        **overrides: AFDConfig fields that win over the environment, e.g.
            ``host=...``, ``num_ffn_ranks=...``, ``connector_extra_config={...}``
            (merged over ``AFD_CONNECTOR_EXTRA_CONFIG``).

    Returns:
        :class:`LaunchedRank` ``(role, role_rank, config)``.

    Raises:
        AFDConfigError: a required variable is missing or does not parse, the
            process count does not match ``A + F``, a role rank is out of range,
            or no rendezvous host is known; the message names the variable.
    """
    from afd_ext.config import AFDConfig

    overrides = dict(overrides)
    A, F = _counts(overrides.pop("num_attention_ranks", None) or envs.get("AFD_NUM_ATTENTION_RANKS"),
                   overrides.pop("num_ffn_ranks", None) or envs.get("AFD_NUM_FFN_RANKS"),
                   _launcher_int("WORLD_SIZE"))
    role, role_rank, ffn0_is_rank0 = resolve_role(A, F)
    host = overrides.pop("host", None) or envs.get("AFD_HOST")
    if host is None:
        if not ffn0_is_rank0:
            raise AFDConfigError(
                "AFD_HOST is not set: FFN rank 0 hosts the AFD rendezvous store, and with AFD_ROLE or an "
                "AFD_ROLES mapping that does not start with 'ffn' it is not torchrun's MASTER_ADDR host; "
                "set AFD_HOST to the address of FFN rank 0's machine")
        host = os.environ.get("MASTER_ADDR")
        if not host:
            raise AFDConfigError("neither AFD_HOST nor torchrun's MASTER_ADDR is set: set AFD_HOST to the "
                                 "address of FFN rank 0's machine")
    port = overrides.pop("port", None) or envs.get("AFD_PORT")
    extra = {**(envs.get("AFD_CONNECTOR_EXTRA_CONFIG") or {}), **(overrides.pop("connector_extra_config", None) or {})}
    fields = {"role": role, "host": host, "num_attention_ranks": A, "num_ffn_ranks": F, "connector_extra_config": extra,
              **({} if port is None else {"port": port}), **overrides}  # the overrides win (port is popped above)
    return LaunchedRank(role, role_rank, AFDConfig(**fields))


def local_device() -> int | None:
    """The CUDA device index this process should use, or None when nothing says.

    ``AFD_DEVICE`` if set; else this rank's entry of ``AFD_ATTENTION_GPUS`` /
    ``AFD_FFN_GPUS`` (``afd-ext launch --attention-gpus/--ffn-gpus``, indexed by
    role rank, one entry shared by all); else torchrun's ``LOCAL_RANK``.

    Raises:
        AFDConfigError: a GPU list does not parse or has the wrong length.
    """
    device = envs.get("AFD_DEVICE")
    if device is not None:
        return device
    lists = {"attention": envs.get("AFD_ATTENTION_GPUS"), "ffn": envs.get("AFD_FFN_GPUS")}
    if any(lists.values()):
        A, F = _counts(envs.get("AFD_NUM_ATTENTION_RANKS"), envs.get("AFD_NUM_FFN_RANKS"), _launcher_int("WORLD_SIZE"))
        role, role_rank, _ = resolve_role(A, F)
        if lists[role]:
            name = "AFD_ATTENTION_GPUS" if role == "attention" else "AFD_FFN_GPUS"
            return int(_gpu_list(lists[role], A if role == "attention" else F, name)[role_rank])
    return _launcher_int("LOCAL_RANK")


def _gpu_list(text: str, n: int, name: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or any(not t.isdigit() for t in items):
        raise AFDConfigError(f"{name} must be a comma-separated list of GPU indices, got {text!r}")
    if len(items) == 1:
        return items * n
    if len(items) != n:
        raise AFDConfigError(f"{name} has {len(items)} entries, expected 1 (shared by all) or {n} (one per rank)")
    return items


# ---------------------------------------------------------------------------
# afd-ext launch: torchrun with the AFD variables set
# ---------------------------------------------------------------------------


def _extra_config(text: str) -> str:
    """``--extra-config``: a JSON object of the fields ``AfdExtConnector`` knows (values are the ranks' to check:
    a transport registered in the rank's own process is named there).
    """
    from dataclasses import fields

    from afd_ext.config import _DEPRECATED_EXTRA, AfdExtConnectorConfig

    try:
        keys = envs.json_object(text)
    except ValueError as e:  # AFDConfigError (a JSON that is not an object) is a ValueError too
        raise argparse.ArgumentTypeError(f"must be a JSON object: {e}") from None
    known = [f.name for f in fields(AfdExtConnectorConfig)]
    if unknown := sorted(set(keys) - set(known) - set(_DEPRECATED_EXTRA)):
        raise argparse.ArgumentTypeError(f"unknown connector_extra_config field(s) {unknown}; known fields: {known}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The ``afd-ext launch`` parser (its own options; every other option before ``--`` goes to torchrun)."""
    p = argparse.ArgumentParser(
        prog="afd-ext launch",
        allow_abbrev=False,  # an abbreviation could swallow a torchrun option
        usage="afd-ext launch -A N -F M [AFD options] [torchrun options] -- command [args ...]",
        description="Run COMMAND as A attention + F FFN ranks under torchrun (torch.distributed.run), with "
                    "the AFD variables exported; inside, afd_ext.tools.launch.config_from_env() says which rank "
                    "is which. Options not listed here (--node-rank, --master-addr, --nproc-per-node, "
                    "--rdzv-*, ...) are passed to torchrun.",
        epilog="Example: afd-ext launch -A 2 -F 1 -- python examples/multinode.py",
    )
    p.add_argument("--num-attention-ranks", "-A", type=ranged(int, 1), required=True,
                   help="A >= 1 (all nodes together)")
    p.add_argument("--num-ffn-ranks", "-F", type=ranged(int, 1), required=True, help="F >= 1 (all nodes together)")
    p.add_argument("--host", default=None,
                   help="AFD rendezvous host, FFN rank 0's address (default: 127.0.0.1 on one node; "
                        "torchrun's MASTER_ADDR on several)")
    p.add_argument("--port", type=ranged(int, 1, 65535), default=None,
                   help="AFD rendezvous port (default: a free port on one node; 1239 on several)")
    p.add_argument("--attention-gpus", default=None,
                   help="GPU index per attention rank, by role rank, e.g. '0,0' (one entry: all share it). "
                        "Each rank uses AFD_DEVICE if set, else its entry here (or --ffn-gpus), else "
                        "torchrun's LOCAL_RANK (its index among the processes on its host)")
    p.add_argument("--ffn-gpus", default=None,
                   help="GPU index per FFN rank, by role rank, e.g. '1' (one entry: all share it)")
    p.add_argument("--extra-config", type=_extra_config, default=None,
                   help="JSON object exported as AFD_CONNECTOR_EXTRA_CONFIG (connector_extra_config); its field "
                        "names are checked against AfdExtConnector's before any rank starts")
    p.add_argument("--nnodes", default="1", help="nodes, N or MIN:MAX (torchrun's --nnodes, passed on to it)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    return p


def check_port_free(host: str, port: int) -> None:
    """Raise now if FFN rank 0 could not bind the AFD rendezvous store to ``host:port`` on this machine.

    The same bind as the store's (:mod:`afd_ext.rendezvous`), released at
    once: a busy port is named in well under a second instead of after every
    rank has started.

    Raises:
        afd_ext.errors.RendezvousError: the port is in use, or ``host`` is not
            an address of this machine; the message says which and what to do.
    """
    from afd_ext.rendezvous.store import _listen_socket

    os.close(_listen_socket(host, port))


def _fail(msg: str, code: int = 2) -> int:
    print(f"afd-ext launch: {msg}", file=sys.stderr, flush=True)
    return code


def _rank_label(rank: int, A: int, F: int) -> str:
    """``"rank 2 (attention rank 1)"`` under the exported mapping, or just ``"rank 2"``."""
    try:
        role, role_rank, _ = resolve_role(A, F, rank=rank, world_size=A + F)
    except AFDConfigError:
        return f"rank {rank}"
    return f"rank {rank} ({'FFN' if role == 'ffn' else role} rank {role_rank})"


def _rank_names(A: int, F: int) -> str:
    """``"rank 0 = FFN 0, ranks 1-2 = attention 0-1"`` (the default, FFN-first order), or the AFD_ROLES mapping."""
    if roles := envs.get("AFD_ROLES"):
        return f"roles by rank: AFD_ROLES={roles}"

    def span(lo: int, n: int, what: str) -> str:
        return f"rank {lo} = {what} 0" if n == 1 else f"ranks {lo}-{lo + n - 1} = {what} 0-{n - 1}"
    return f"{span(0, F, 'FFN')}, {span(F, A, 'attention')}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``afd-ext launch``; returns the exit code.

    0 when every rank succeeded; the first failing rank's code (``128 +
    signal`` when a signal killed it); ``128 + signal`` when the launcher got
    SIGTERM/SIGINT/SIGHUP (every rank is stopped first); 127 when the command
    is not found; 2 for bad arguments (one line on stderr, no traceback).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    i = argv.index("--") if "--" in argv else len(argv)
    own, cmd = argv[:i], argv[i + 1:]
    parser = build_parser()
    args, torchrun_opts = parser.parse_known_args(own)
    if not cmd:
        parser.error("give the command to run after '--', e.g. -- python script.py")
    A, F = args.num_attention_ranks, args.num_ffn_ranks
    try:
        for text, n, flag in ((args.attention_gpus, A, "--attention-gpus"), (args.ffn_gpus, F, "--ffn-gpus")):
            if text is not None:
                _gpu_list(text, n, flag)
    except AFDConfigError as e:
        parser.error(str(e))
    one_node = args.nnodes.rsplit(":", 1)[-1].strip() == "1"  # torchrun refuses a malformed --nnodes itself
    if args.port is not None and one_node:
        try:  # FFN rank 0 binds it on this machine; before torch is imported, so it takes well under a second
            check_port_free(args.host or "127.0.0.1", args.port)
        except AFDError as e:
            return _fail(f"{type(e).__name__}: {e}")
    exe = cmd[0]
    if (shutil.which(exe) if os.sep not in exe else (os.path.isfile(exe) and os.access(exe, os.X_OK))) in (None, False):
        return _fail(f"command not found or not executable: {exe!r}", 127)

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    prefix = [] if args.no_prefix else ["--tee", "3"]
    # Our defaults first: argparse keeps the last occurrence, so the user's torchrun options win.
    tr_parser = torchrun.get_args_parser()
    tr_parser.prog, tr_parser.allow_abbrev = "afd-ext launch (torchrun options)", False  # --nnodes is ours alone
    targs = tr_parser.parse_args(["--nproc-per-node", str(A + F), "--nnodes", args.nnodes, *prefix, *torchrun_opts,
                                  "--no-python", *cmd])
    if one_node and int(targs.nproc_per_node) != A + F:
        parser.error(f"on one node --nproc-per-node must be A + F = {A + F}, got {targs.nproc_per_node}")
    host = args.host or ("127.0.0.1" if one_node else None)
    port = args.port
    if port is None and one_node:
        from afd_ext.tools.testing import find_free_port

        port = find_free_port(host)
    exported = {"AFD_NUM_ATTENTION_RANKS": str(A), "AFD_NUM_FFN_RANKS": str(F), "AFD_HOST": host,
                "AFD_PORT": None if port is None else str(port), "AFD_CONNECTOR_EXTRA_CONFIG": args.extra_config,
                "AFD_ATTENTION_GPUS": args.attention_gpus, "AFD_FFN_GPUS": args.ffn_gpus}
    for stale in ("AFD_ROLE", "AFD_ROLE_RANK"):  # would override the rank-derived role in every process
        os.environ.pop(stale, None)
    os.environ.update({k: v for k, v in exported.items() if v is not None})
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own choice, without its warning banner
    # The variable, not the --log-line-prefix-template option, which torch < 2.13 lacks.
    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank ${rank}] ")
    where = f"{host or '$MASTER_ADDR'}:{port or 1239}"
    print(f"afd-ext launch: {A} attention + {F} FFN ranks ({_rank_names(A, F)}); AFD rendezvous {where}",
          file=sys.stderr, flush=True)
    try:
        torchrun.run(targs)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode  # -N: killed by signal N
        return _fail(f"{_rank_label(rank, A, F)} exited with code {code}; torchrun stopped the other ranks",
                     code or 1)
    except SignalException as e:
        return _fail(f"got {e.sigval.name}; every rank was stopped", 128 + int(e.sigval))
    return 0

