"""afd_ext as a connector of the reference vLLM AFD plugin (``vllm-project/afd-plugin``).

Why this module exists: the reference's runners build their connector through
their own factory, which loads a registered class lazily, refuses anything
that is not a subclass of ``afd_plugin.connectors.base.AFDConnectorBase``, and
calls it as ``cls(rank, local_rank, vllm_config, afd_config, role_rank)`` with
the reference's own ``AFDConfig``. :class:`AfdExtAFDConnector` is such a
subclass: it translates that configuration, reads the model facts from
``vllm_config``, and delegates every call to :class:`afd_ext.connector.AFDConnector`
through its public methods only. Nothing here is imported by ``import afd_ext``;
this module imports ``afd_plugin`` (and with it whatever the plugin imports)
only when it is itself imported.

Registration: vLLM calls every ``vllm.general_plugins`` entry point at
start-up; ours is :func:`register`. It registers the class under
``"AfdExtConnector"`` and, only when ``AFD_EXT_REPLACE_P2P=1`` is set, also
under the reference's ``"P2pNcclAFDConnector"`` (``replace=True``). The
second name is what the real runners need: their config validation accepts
only the reference's three connector names, and choosing
``P2pNcclAFDConnector`` also applies the reference's ``validate_p2p_topology``
(``A >= F``, and ``A % F == 0`` at afd-plugin 2e4378f). ``docs/vllm.md`` says what a user writes.

What changes under the reference's runners (all documented in ``docs/vllm.md``):

* ``clamp_idle_to_one`` defaults to True: an idle DP rank runs a one-token
  dummy batch and the reference counts it as one row.
* The layer exchanges per step are all decoder layers, or, with
  ``compute_gate_on_attention``, only the MoE layers (counted from the model
  config, or ``connector_extra_config.num_exchange_layers``); router logits
  then travel with width ``n_routed_experts`` / ``num_experts`` /
  ``num_local_experts`` and the dtype vLLM's gate emits
  (:func:`afd_ext.spec.router_logits_dtype`: float32 for ``glm_moe_dsa`` or
  ``moe_router_dtype: "float32"``, else the model dtype). Each
  ``routing_spec`` the FFN runner passes is checked against them.
* An orderly close (this rank's ``close()`` or the source's goodbye) ends
  afd-plugin's FFN worker loop thread quietly with ``SystemExit``, raised on
  that thread only (``_end_loop`` says why this is safe); a dead, silent or
  aborting peer still raises its named error, which the loop records. With
  ``on_attention_exit: "rejoin"`` the attention side's exit between steps
  (goodbye or death) re-initialises the connector instead, and the loop
  serves the restarted attention ranks (``_rejoin``).
* Facts come from :meth:`afd_ext.spec.ExchangeSpec.from_vllm_config` (the one
  parser, shared with afd_ext's own connector): the init handshake compares
  hidden size, layers, dtypes and the options, not each role's own TP size
  (an FFN rank expands whatever per-DP count vector arrives, the reference's
  rule; an attention rank accepts only vectors of its own DP size).
* Attention-side calls made while ``torch.compile`` traces go through two
  custom ops (``torch.ops.afd_ext_plugin.*``) keyed by an integer handle, so
  the compiled graph calls the connector on every step (no per-step state
  frozen at trace time; under DBO the stage is this thread's vLLM ubatch id,
  read when the op runs). A step whose payload sets ``is_graph_capturing``
  takes its buffers from a fresh static arena that is never freed (the
  reference's FFN runner replays captured graphs without calling the
  connector) and pauses the NCCL watchdog's event polling until a payload
  without the flag arrives (event queries invalidate a global-mode capture).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from typing import Any, Mapping, Optional

import torch

from .. import envs
from ..config import DEFAULT_CONNECTOR, REFERENCE_CONNECTOR, AFDConfig, AfdExtConnectorConfig, coerce_bool, coerce_int
from ..errors import AFDClosedError, AFDConfigError, AFDError, AFDStateError, ControlChannelClosed, PeerClosedError
from ..errors import PeerDeadError
from ..metadata import AFDControlPayload, AFDTransferContext, AFDTransferMetadata
from ..spec import ExchangeSpec, as_dtype, dtype_name

logger = logging.getLogger(__name__)

#: The name this connector is always registered under in the reference's factory.
PLUGIN_CONNECTOR_NAME = DEFAULT_CONNECTOR

#: ``connector_extra_config`` keys read by this adapter itself (the rest are afd_ext's).
_ADAPTER_KEYS = ("num_exchange_layers", "router_logits_dtype", "send_token_ids", "on_attention_exit")

try:
    from afd_plugin.connectors.base import AFDConnectorBase as _ConnectorBase
    from afd_plugin.connectors.base import AFDControlPlane as _ControlPlaneBase
    from afd_plugin.connectors.base import ConnectorExtraInfo as _ExtraInfoBase

    HAVE_AFD_PLUGIN = True
except ImportError as _e:  # the module stays importable (register() is a no-op then)
    HAVE_AFD_PLUGIN = False
    _IMPORT_ERROR: ImportError | None = _e
else:
    _IMPORT_ERROR = None


#: Names of the threads afd-plugin's FFN workers run their loop on (``ffn_worker.py`` and
#: ``npu/ffn_worker.py`` at 2e4378f); only there does an orderly close raise ``SystemExit``.
PLUGIN_FFN_LOOP_THREADS = frozenset({"afd-ffn-worker-loop", "afd-npu-ffn-worker-loop"})


#: The vLLM releases the integration suite (``make test-vllm``, ``tests/integration_vllm/``) runs against,
#: one environment each (``tests/integration_vllm/pins*.txt``; docs/vllm.md says what each runs).
TESTED_VLLM_VERSIONS = ("0.26.0", "0.30.0")


def versions() -> dict[str, str | None]:
    """``{"afd_ext", "vllm", "afd_plugin"}`` versions installed (``None``: not installed)."""
    from importlib import metadata

    from .. import __version__

    out: dict[str, str | None] = {"afd_ext": __version__}
    for key, dist in (("vllm", "vllm"), ("afd_plugin", "vllm-afd-plugin")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out


def factory_report() -> dict[str, Any]:
    """What afd-plugin's connector factory resolves here, set up as a vLLM process sets it up (``afd-ext info``).

    Loads vLLM's general plugins as vLLM does at start-up (``VLLM_PLUGINS`` and
    ``AFD_EXT_REPLACE_P2P`` honoured), then asks the factory for the class of
    ``"P2pNcclAFDConnector"`` (the name the reference's runners accept) and of
    ``"AfdExtConnector"``.

    Returns:
        :func:`versions` plus ``tested_vllm`` (:data:`TESTED_VLLM_VERSIONS`) and ``factory``: ``{name:
        "module.Class" or "not resolvable: ..."}``, or ``None`` with ``why``
        when afd-plugin is not installed.
    """
    out: dict[str, Any] = {**versions(), "tested_vllm": list(TESTED_VLLM_VERSIONS), "factory": None, "why": None}
    if out["afd_plugin"] is None or not HAVE_AFD_PLUGIN:
        out["why"] = "afd-plugin is not installed" if out["afd_plugin"] is None else f"not importable: {_IMPORT_ERROR}"
        return out
    if out["vllm"] is not None:
        from vllm.plugins import load_general_plugins

        vlog = logging.getLogger("vllm")  # quiet while vLLM loads its plugins: it logs to stdout
        level = vlog.level
        vlog.setLevel(logging.ERROR)
        try:
            load_general_plugins()
        finally:
            vlog.setLevel(level)
    else:
        register()
    from afd_plugin.connectors.factory import AFDConnectorFactory

    found = {}
    for name in (REFERENCE_CONNECTOR, PLUGIN_CONNECTOR_NAME):
        try:
            cls = AFDConnectorFactory.get_connector_class(name)
            found[name] = f"{cls.__module__}.{cls.__qualname__}"
        except Exception as e:  # noqa: BLE001 - reported, not raised: this is a diagnosis
            found[name] = f"not resolvable: {type(e).__name__}: {e}"
    out["factory"] = found
    return out


_WARNED_UNTESTED: list[str] = []


def _log_connected(conn: Any) -> None:
    """The INFO line saying afd_ext is the transport; once per process, a warning on an untested vLLM."""
    v = versions()
    inner = conn._inner
    kinds = sorted({getattr(ch, "kind", "?") for ch in getattr(inner.control_plane, "channels", {}).values()})
    logger.info("afd_ext %s is the AFD connector (vLLM %s, afd-plugin %s): %s, transport %s, topology %dA%dF, "
                "control channel %s", v["afd_ext"], v["vllm"], v["afd_plugin"], inner.peer_map.me,
                inner.transport_kind, inner.attn_size, inner.ffn_size, "/".join(kinds) or "none")
    if v["vllm"] is not None and v["vllm"] not in TESTED_VLLM_VERSIONS and not _WARNED_UNTESTED:
        _WARNED_UNTESTED.append(v["vllm"])  # a worker that reconnects says it once
        logger.warning("afd_ext is tested with vLLM %s (make test-vllm); this is vLLM %s",
                       ", ".join(TESTED_VLLM_VERSIONS), v["vllm"])


def _check_contract(cls: type) -> None:
    """Refuse to build ``cls`` when the installed afd-plugin's bases declare members afd_ext lacks.

    Raises:
        AFDConfigError: names every missing abstract member (of the connector
            and of its control plane) with the afd_ext and afd-plugin versions.
    """
    pairs = ((cls, _ConnectorBase), (_PluginControlPlane, _ControlPlaneBase))
    missing = [f"{base.__name__}.{name}" for c, base in pairs for name in sorted(getattr(c, "__abstractmethods__", ()))]
    if missing:
        v = versions()
        raise AFDConfigError(
            f"afd_ext {v['afd_ext']} does not implement {', '.join(missing)}, abstract in the installed "
            f"afd-plugin {v['afd_plugin'] or '(version unknown)'}: install the afd-plugin version afd_ext supports "
            "(docs/vllm.md, Versions) or an afd_ext that implements them")


def _end_loop(why: str, cause: BaseException) -> None:
    """End afd-plugin's FFN loop thread after an orderly close: raise ``SystemExit``.

    Why ``SystemExit`` (exactly that class: ``threading.excepthook`` ignores
    only ``SystemExit`` itself, not a subclass): the loop
    (``AFDFFNWorker.start_ffn_server_loop``) records any ``Exception`` as a
    failure and has no other exit while it waits for a payload; a
    ``SystemExit`` passes its ``except Exception``, and Python's ``threading``
    ends the thread on it quietly, so ``stop_ffn_server_loop`` finds the thread
    ended and no error, and vLLM's ``Worker.shutdown()`` runs. Raised only on
    that loop's own thread (:data:`PLUGIN_FFN_LOOP_THREADS`): any other caller
    (the main thread included, where a ``SystemExit`` would end the process)
    gets the named :class:`afd_ext.errors.AFDError`. The cause is chained.
    """
    logger.info("afd_ext: the AFD FFN worker loop ends (%s)", why)
    raise SystemExit(f"AFD FFN worker loop ended: {why}") from cause


def _rejoin(owner: Any, e: AFDError) -> bool:
    """``on_attention_exit: "rejoin"``: after the attention side's exit between steps (its goodbye, or its
    death), close and re-initialise ``owner``'s connector, which takes the restarted attention ranks in
    the next generation; returns True when it did (the caller receives again), False when it does not apply.

    The wait is the rendezvous's, bounded by ``init_timeout_s`` (a restarted attention server loads its
    weights again before it joins, as at its first start): one WARNING line here, then one every
    interval from ``afd_ext.rendezvous`` naming the ranks awaited; past it the rendezvous's named
    ``RendezvousTimeoutError``, which the loop records. A local ``close()`` ends the wait at once.

    Raises:
        AFDError: the re-initialisation failed (the connector is then closed).
    """
    gone = type(e) is ControlChannelClosed or isinstance(e, (PeerClosedError, PeerDeadError))
    if owner.extra_info.config.on_attention_exit != "rejoin" or owner._closing or not gone:
        return False
    inner, t0 = owner._inner, time.monotonic()
    logger.warning("afd_ext: %s: %s: %s; on_attention_exit is 'rejoin': waiting up to init_timeout_s (%.0f s) "
                   "for the %d restarted attention rank(s) to rejoin", inner.peer_map.me, type(e).__name__,
                   str(e).splitlines()[0], inner.extra.init_timeout_s, owner.attn_size)
    inner.close()
    inner.init_afd_connector()  # a close() from another thread ends its wait at once (AFDClosedError)
    if owner._closing:  # close() came as the wait ended
        inner.close()
        raise AFDClosedError(f"{inner.peer_map.me}: closed while the attention side rejoined")
    logger.info("afd_ext: %s: the attention side rejoined after %.1f s", inner.peer_map.me, time.monotonic() - t0)
    return True


def _end_loop_if_stopped(owner: Any, e: AFDError) -> None:
    """On afd-plugin's FFN loop thread, end the loop (:func:`_end_loop`) when ``e`` comes from a stop: this
    connector's ``close()``, or a peer's orderly close (its goodbye, or its close with a step in flight)."""
    stopped = owner._closing or type(e) is ControlChannelClosed or isinstance(e, PeerClosedError)
    if stopped and threading.current_thread().name in PLUGIN_FFN_LOOP_THREADS:
        _end_loop("this FFN rank's connector was closed" if owner._closing else str(e), e)


# ---------------------------------------------------------------------------
# Registration (the vllm.general_plugins entry point)
# ---------------------------------------------------------------------------


def register() -> None:
    """Register afd_ext into the reference's connector factory (vLLM calls it at start-up).

    Always registers ``"AfdExtConnector"``; with ``AFD_EXT_REPLACE_P2P=1``
    also ``"P2pNcclAFDConnector"`` (replacing the reference's own class), the
    only way to pass the reference runners' connector allow-list. Without
    ``afd_plugin`` installed it does nothing (logged at debug level).

    Raises:
        AFDConfigError: ``AFD_EXT_REPLACE_P2P`` is not a boolean.
    """
    replace_p2p = envs.get("AFD_EXT_REPLACE_P2P")
    if not HAVE_AFD_PLUGIN:
        logger.debug("afd_plugin is not importable (%s): afd_ext not registered with it", _IMPORT_ERROR)
        if replace_p2p:
            logger.warning("AFD_EXT_REPLACE_P2P=1 but afd_plugin is not importable (%s)", _IMPORT_ERROR)
        return
    from afd_plugin.connectors.factory import AFDConnectorFactory

    AFDConnectorFactory.register_connector(PLUGIN_CONNECTOR_NAME, __name__, "AfdExtAFDConnector", replace=True)
    if replace_p2p:
        AFDConnectorFactory.register_connector(REFERENCE_CONNECTOR, __name__, "AfdExtAFDConnector", replace=True)
        logger.info("afd_ext replaces the reference's %s (AFD_EXT_REPLACE_P2P=1)", REFERENCE_CONNECTOR)


# ---------------------------------------------------------------------------
# Configuration and model facts
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AdapterExtraConfig:
    """This connector's ``connector_extra_config`` under the reference: afd_ext's fields plus three of its own.

    Attributes:
        connector: afd_ext's typed extra config; ``clamp_idle_to_one``
            defaults to True here (the reference's runners run a one-token
            dummy batch on idle DP ranks).
        num_exchange_layers: layer exchanges per step when the model config
            does not tell (``None``: counted from it).
        router_logits_dtype: dtype of router logits on the wire (``None``: what vLLM's
            gate emits, :func:`afd_ext.spec.router_logits_dtype`; not needed for vLLM's models).
        send_token_ids: ``[rows]`` int32 token ids travel with the hidden states
            (the reference's ``input_ids`` / ``recv_input_ids``, DeepSeek-V4 hash routing).
        on_attention_exit: what afd-plugin's FFN worker loop does when the attention side exits
            between steps: ``"exit"`` (default: it ends, quietly after a goodbye) or ``"rejoin"`` (it
            waits, up to ``init_timeout_s``, for the restarted attention ranks and serves them; needs
            ``enforce_eager``; read on the FFN role). docs/vllm.md, "5. Restart one role".
    """

    connector: AfdExtConnectorConfig
    num_exchange_layers: int | None = None
    router_logits_dtype: str | None = None
    send_token_ids: bool = False
    on_attention_exit: str = "exit"

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> "AdapterExtraConfig":
        """Parse ``connector_extra_config``.

        Raises:
            TypeError: not a mapping, or a value of the wrong type.
            AFDConfigError / ValueError: unknown key (all accepted keys listed), a
                value out of range (see :meth:`afd_ext.config.AfdExtConnectorConfig.from_mapping`),
                ``fp8_delivery: "fp8"`` (the plugin's FFN models take bf16).
        """
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise TypeError("connector_extra_config must be a mapping")
        rest = dict(raw)
        known = [f.name for f in dataclasses.fields(AfdExtConnectorConfig)] + list(_ADAPTER_KEYS)
        unknown = sorted(k for k in rest if k not in known)
        if unknown:
            # Also in afd-plugin's words ("does not support connector_extra_config"), which its tests match.
            raise AFDConfigError(f"unknown connector_extra_config field(s) {unknown}: afd_ext under afd-plugin does "
                                 f"not support connector_extra_config fields other than {known}")
        layers = rest.pop("num_exchange_layers", None)
        if layers is not None:
            layers = coerce_int(layers, "connector_extra_config.num_exchange_layers")
            if layers < 1:
                raise AFDConfigError(f"connector_extra_config.num_exchange_layers must be >= 1, got {layers}")
        ldtype = rest.pop("router_logits_dtype", None)
        if ldtype is not None:
            ldtype = dtype_name(as_dtype(ldtype, "connector_extra_config.router_logits_dtype"))
        ids = coerce_bool(rest.pop("send_token_ids", False), "connector_extra_config.send_token_ids")
        on_exit = rest.pop("on_attention_exit", "exit")
        if on_exit not in ("exit", "rejoin"):
            raise AFDConfigError(f"connector_extra_config.on_attention_exit must be 'exit' or 'rejoin', "
                                 f"got {on_exit!r}")
        rest.setdefault("clamp_idle_to_one", True)
        connector = AfdExtConnectorConfig.from_mapping(rest)
        if connector.fp8_delivery == "fp8":
            # The plugin's FFN models take bf16 activations (docs/fp8.md): refuse before any step, not at step 1.
            raise AFDConfigError("connector_extra_config.fp8_delivery 'fp8' hands the FFN float8 activations, which "
                                 "afd-plugin's FFN models cannot take; use 'dequant' (the default) under afd-plugin")
        return cls(connector, layers, ldtype, ids, on_exit)

    def to_mapping(self) -> dict[str, Any]:
        """All fields as one flat mapping (round-trips through :meth:`from_mapping`)."""
        out = self.connector.to_mapping()
        out.update({k: getattr(self, k) for k in _ADAPTER_KEYS if getattr(self, k) not in (None, False, "exit")})
        return out


def exchange_spec(vllm_config: Any, afd_config: Any, extra: AdapterExtraConfig) -> ExchangeSpec:
    """The exchange's facts of a vLLM worker (:meth:`afd_ext.spec.ExchangeSpec.from_vllm_config`).

    Raises:
        AFDConfigError: a fact is missing; the message names every missing field.
    """
    return ExchangeSpec.from_vllm_config(
        vllm_config, role=afd_config.role, compute_gate_on_attention=bool(afd_config.compute_gate_on_attention),
        num_exchange_layers=extra.num_exchange_layers, router_logits_dtype=extra.router_logits_dtype,
        send_token_ids=extra.send_token_ids)


# ---------------------------------------------------------------------------
# Custom ops: the attention-side calls as seen by torch.compile
# ---------------------------------------------------------------------------

#: True only while Dynamo traces (constant-folded there); ~0.06 us eagerly against ~0.2 us for
#: ``torch.compiler.is_compiling``, and it runs twice per layer exchange.
_tracing = torch.compiler.is_dynamo_compiling

_LIVE: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def _live(handle: int) -> Any:
    conn = _LIVE.get(handle)
    if conn is None:
        raise AFDStateError(f"afd_ext plugin connector handle {handle} is gone (its connector was garbage-collected; "
                            "a graph compiled against it cannot run)")
    return conn


_DBO: list = []


def _runtime_stage(traced: int) -> int:
    """The stage of a compiled call: this thread's vLLM DBO ubatch when DBO runs, else the traced value.

    vLLM dispatches a compiled model without re-evaluating Dynamo's guards, so
    a stage read in Python while tracing (the proxy's ``ubatch_idx``) is frozen
    in the graph; the ubatch thread's id is read here, at run time.
    """
    if not _DBO:
        try:
            from vllm.v1.worker.ubatching import dbo_current_ubatch_id, dbo_enabled
        except ImportError:
            _DBO.append(None)
        else:
            _DBO.append((dbo_enabled, dbo_current_ubatch_id))
    fns = _DBO[0]
    if fns is not None and fns[0]():
        return int(fns[1]())
    return traced


@torch.library.custom_op("afd_ext_plugin::send_attn_output", mutates_args=("hidden_states",))
def _send_attn_op(hidden_states: torch.Tensor, parts: list[Optional[torch.Tensor]], handle: int, layer_idx: int,
                  stage: int) -> None:
    # Declared as mutating hidden_states (it does not) so the compiler keeps and orders the call.
    # parts: the keywords of the connector's part_args, in that order (None: not given).
    _live(handle)._send_rows(hidden_states, layer_idx, _runtime_stage(stage), parts)


@_send_attn_op.register_fake
def _(hidden_states, parts, handle, layer_idx, stage) -> None:
    return None


@torch.library.custom_op("afd_ext_plugin::recv_ffn_output", mutates_args=("out",))
def _recv_ffn_op(out: torch.Tensor, handle: int, stage: int) -> None:
    _live(handle)._inner.recv_ffn_output(out, ubatch_idx=_runtime_stage(stage))


@_recv_ffn_op.register_fake
def _(out, handle, stage) -> None:
    return None


# ---------------------------------------------------------------------------
# The connector
# ---------------------------------------------------------------------------

if HAVE_AFD_PLUGIN:

    @dataclasses.dataclass(frozen=True)
    class AfdExtExtraInfo(_ExtraInfoBase):
        """The reference's ``ConnectorExtraInfo`` for this connector (wraps :class:`AdapterExtraConfig`)."""

        config: AdapterExtraConfig

        @classmethod
        def from_mapping(cls, raw: Mapping[str, Any] | None) -> "AfdExtExtraInfo":
            return cls(AdapterExtraConfig.from_mapping(raw))

        def to_mapping(self) -> dict[str, Any]:
            return self.config.to_mapping()

    class _PluginControlPlane(_ControlPlaneBase):
        """The reference's control-plane methods, taking the reference's payload objects."""

        def __init__(self, owner: "AfdExtAFDConnector"):
            self._owner = owner

        def update_state_from_dp_metadata(self, payload: Any) -> None:
            """Apply a payload locally (see :meth:`AfdExtAFDConnector.apply_payload`)."""
            try:
                self._owner.apply_payload(payload)
            except AFDError as e:
                _end_loop_if_stopped(self._owner, e)
                raise

        def send_dp_metadata_list(self, payload: Any) -> None:
            """Send the payload to this attention rank's FFN destinations (no-op on other ranks)."""
            self._owner._inner.control_plane.send_dp_metadata_list(self._owner._convert(payload, just_applied=True))

        def recv_dp_metadata_list(self) -> AFDControlPayload:
            """FFN side: block until the next payload (afd_ext's class; the runners read its fields).

            Raises:
                SystemExit: on afd-plugin's FFN loop thread only, when this connector
                    was closed (``close()``) or a peer closed in order (the source
                    attention rank's goodbye, or ``PeerClosedError``): the loop thread
                    ends quietly (see ``_end_loop`` for why this is safe). With
                    ``on_attention_exit: "rejoin"`` a peer's exit re-initialises instead
                    (``_rejoin``) and the next payload is the restarted attention side's.
                AFDError: every other failure (a dead or silent peer, an abort, a
                    timeout, a rejoin that failed), and an orderly close on any other thread.
            """
            owner = self._owner
            owner._leave_capture()
            while True:
                try:
                    return owner._inner.control_plane.recv_dp_metadata_list()
                except AFDError as e:
                    try:
                        if _rejoin(owner, e):
                            continue
                    except AFDError as again:
                        _end_loop_if_stopped(owner, again)
                        raise
                    _end_loop_if_stopped(owner, e)
                    raise

    class AfdExtAFDConnector(_ConnectorBase):
        """afd_ext's connector behind the reference's ``AFDConnectorBase`` contract.

        Args:
            rank: vLLM world rank (informational).
            local_rank: CUDA device index.
            vllm_config: the worker's ``VllmConfig`` (model facts, DP size; the
                ``"afd"`` section's ``connector_extra_config``).
            afd_config: the reference's ``AFDConfig`` (read by its fields).
            role_rank: resolved by the reference's factory.

        Construction is device-light (no communication).

        Raises:
            AFDConfigError: the installed afd-plugin's bases declare an abstract
                member this class lacks (named, with both versions; checked
                before anything else), ``async_dp`` set, or a model fact missing
                from ``vllm_config``.
            AFDConfigError / TypeError: a bad ``connector_extra_config`` or role rank.
        """

        #: Read as a plain attribute by afd-plugin's newer attention modules: yield to the other DBO
        #: ubatch between send and receive, as 2e4378f's do always (each stage has its own streams here).
        yield_after_attn_send = True

        def __new__(cls, *args: Any, **kwargs: Any) -> "AfdExtAFDConnector":
            _check_contract(cls)  # else Python's TypeError, raised inside afd-plugin's factory under vLLM
            return super().__new__(cls)

        def __init__(self, rank: int, local_rank: int, vllm_config: Any, afd_config: Any, role_rank: int) -> None:
            super().__init__(rank, local_rank, vllm_config, afd_config, role_rank)
            from ..connector import AFDConnector

            if getattr(afd_config, "async_dp", False):
                raise AFDConfigError("afd_ext is a synchronous connector; set async_dp (async) to false")
            info: AdapterExtraConfig = self.extra_info.config
            eager = getattr(getattr(vllm_config, "model_config", None), "enforce_eager", True)
            if info.on_attention_exit == "rejoin" and afd_config.role == "ffn" and not eager:
                # The FFN runner keeps the graphs it captured, against this generation's transport.
                raise AFDConfigError("connector_extra_config.on_attention_exit 'rejoin' needs enforce_eager under "
                                     "afd-plugin's runners: its FFN runner would replay graphs captured against "
                                     "the previous generation's transport; run with --enforce-eager")
            if info.connector.strict and not eager:
                # The runners capture and replay graphs on each side at different steps (the FFN
                # replays while the attention side may run eagerly): header-less graph traffic
                # would meet header-checking eager traffic.
                raise AFDConfigError("connector_extra_config.strict needs enforce_eager under the reference's "
                                     "runners (CUDA graphs carry no strict-mode headers); set strict to false "
                                     "or run with --enforce-eager")
            gate = bool(afd_config.compute_gate_on_attention)
            cfg = AFDConfig(connector=DEFAULT_CONNECTOR, role=afd_config.role, port=afd_config.port,
                            host=afd_config.host, num_attention_ranks=afd_config.num_attention_ranks,
                            num_ffn_ranks=afd_config.num_ffn_ranks, compute_gate_on_attention=gate,
                            connector_extra_config=info.connector.to_mapping())
            self.spec = exchange_spec(vllm_config, afd_config, info)
            self._inner = AFDConnector(rank, local_rank, cfg, role_rank, **dataclasses.asdict(self.spec))
            #: send_attn_output's keywords after hidden_states: the parts that travel (afd_ext.wire), in wire order.
            self.part_args = tuple(p.arg for p in self._inner.schedule_config.caller_parts if p.arg != "hidden_states")
            self.attn_size = cfg.num_attention_ranks
            self.ffn_size = cfg.num_ffn_ranks
            self.control_plane = _PluginControlPlane(self)
            self._capture = contextlib.ExitStack()
            self._capturing = False
            self._arenas: list[Any] = []
            self._last: tuple[Any, AFDControlPayload] | None = None
            self._spec_ok: Any = None
            self._closing = False
            self._handle = next(_HANDLES)
            _LIVE[self._handle] = self

        @classmethod
        def parse_extra_config(cls, raw: Mapping[str, Any] | None) -> AfdExtExtraInfo:
            """Parse ``connector_extra_config`` (afd_ext's fields and :class:`AdapterExtraConfig`'s own three).

            Raises:
                TypeError / ValueError: not a mapping, unknown key, bad value.
            """
            return AfdExtExtraInfo.from_mapping(raw)

        # -- lifecycle --------------------------------------------------------

        @property
        def connector(self) -> Any:
            """The delegate :class:`afd_ext.connector.AFDConnector`."""
            return self._inner

        @property
        def is_initialized(self) -> bool:
            return self._inner.is_initialized

        def init_afd_connector(self) -> None:
            """Rendezvous, handshake, transport, control channels, warm-up (collective; idempotent)."""
            self._closing = False
            fresh = not self._inner.is_initialized
            self._inner.init_afd_connector()
            if fresh:
                _log_connected(self)

        def close(self) -> None:
            """Release everything (idempotent); graph arenas stay alive while a captured graph may replay.

            afd-plugin's FFN loop thread, blocked in any afd_ext call or wait
            (``recv_dp_metadata_list``, or mid-step in ``recv_attn_output`` /
            ``send_ffn_output``, or ``_rejoin``'s wait for a restarted attention
            side), wakes and ends quietly (``SystemExit``); the peers get
            :class:`~afd_ext.errors.PeerClosedError`.
            """
            self._closing = True
            self._leave_capture()
            self._last = None
            self._inner.close()

        # -- control plane ------------------------------------------------------

        def _convert(self, payload: Any, *, just_applied: bool = False) -> AFDControlPayload:
            # The attention runner sends the very payload it applied a moment before: convert once.
            last, self._last = self._last, None
            if just_applied and last is not None and last[0] is payload:
                return last[1]
            return AFDControlPayload.from_fields(payload)

        def apply_payload(self, payload: Any) -> None:
            """``control_plane.update_state_from_dp_metadata``: validate, build the step, take its buffers.

            A payload with ``is_graph_capturing`` takes its buffers from a new
            static arena (kept for the process's life: a captured graph replays
            without any connector call) and pauses the NCCL watchdog's event
            polling until a payload without the flag (or, FFN side, the next
            ``recv_dp_metadata_list``).

            Raises:
                AFDConfigError / AFDStateError: see afd_ext's ``update_state_from_dp_metadata``
                    (an attention rank refuses a count vector that is neither per DP
                    rank nor per attention rank; nothing moved).
            """
            p = self._convert(payload)
            if not p.is_graph_capturing:
                self._leave_capture()
                self._inner.control_plane.update_state_from_dp_metadata(p)
                self._last = (payload, p)
                return
            from ..graphs import StaticArena

            arena = StaticArena(self._inner.device, label=f"reference-runner capture {len(self._arenas)}")
            self._inner.use_static_arena(arena)
            try:
                self._inner.control_plane.update_state_from_dp_metadata(p)
            finally:
                self._inner.use_static_arena(None)
            arena.freeze()
            self._arenas.append(arena)
            self._last = (payload, p)
            if not self._capturing:
                self._capture.enter_context(self._inner.watchdog_suspended())
                self._capturing = True

        def _leave_capture(self) -> None:
            if self._capturing:
                self._capturing = False
                self._capture.close()

        # -- attention side -----------------------------------------------------

        def send_attn_output(self, hidden_states: torch.Tensor, context: Any, **kwargs: Any) -> None:
            """Send this rank's rows of one (layer, stage); ``context`` is read by its fields.

            Args:
                hidden_states: ``[rows, hidden_size]`` of the model dtype; ``rows``
                    this rank's count of the stage (1 for an idle rank's dummy batch).
                context: an ``AFDTransferContext`` (the reference's or ours).
                **kwargs: ``router_logits`` ``[rows, width]`` (gate on attention),
                    ``input_ids`` ``[rows]`` int32, the keyword of a part declared with
                    :func:`afd_ext.wire.declare_part` (before this connector was built); others are ignored.

            Raises:
                AFDConfigError / AFDStateError / AFDError: see afd_ext's ``send_attn_output``.
            """
            if _tracing():
                md = context.metadata
                torch.ops.afd_ext_plugin.send_attn_output(hidden_states, [kwargs.get(a) for a in self.part_args],
                                                          self._handle, md.layer_idx, md.stage_idx)
                return
            self._inner.send_attn_output(hidden_states, context, **kwargs)

        def _send_rows(self, hidden_states: torch.Tensor, layer_idx: int, stage: int,
                       parts: list[torch.Tensor | None]) -> None:
            ctx = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(
                layer_idx=layer_idx, stage_idx=stage, seq_len=int(hidden_states.shape[0])))
            self._inner.send_attn_output(hidden_states, ctx, **dict(zip(self.part_args, parts)))

        def recv_ffn_output(self, ref_tensor: torch.Tensor, ubatch_idx: int = 0, **kwargs: Any) -> torch.Tensor:
            """Receive the reply of the oldest outstanding exchange into ``ref_tensor`` and return it."""
            if _tracing():
                torch.ops.afd_ext_plugin.recv_ffn_output(ref_tensor, self._handle, ubatch_idx)
                return ref_tensor
            return self._inner.recv_ffn_output(ref_tensor, ubatch_idx=ubatch_idx)

        # -- FFN side -------------------------------------------------------------

        def recv_attn_output(self, ubatch_idx: int = 0, **kwargs: Any) -> Any:
            """Fan-in of the next (layer, stage); returns afd_ext's ``AFDA2FTransferPayload``.

            Args:
                ubatch_idx: the stage.
                **kwargs: ``routing_spec`` (checked against the configured router
                    logits), ``recv_input_ids``; others are ignored.

            Raises:
                AFDConfigError: ``routing_spec`` differs from what this connector
                    configured from the model config (the message says what to set).
                AFDConfigError / AFDStateError / AFDError: see afd_ext's ``recv_attn_output``.
                SystemExit: on afd-plugin's FFN loop thread only, when this connector or a
                    peer closed in order (see ``recv_dp_metadata_list``).
            """
            spec = kwargs.get("routing_spec")
            if spec is not None and spec != self._spec_ok:  # checked before the connector is touched
                from ..connector.step import check_routing_spec

                check_routing_spec(spec, self.spec.router_logits_width, self.spec.router_logits_dtype)
                self._spec_ok = spec
            try:
                return self._inner.recv_attn_output(ubatch_idx=ubatch_idx, routing_spec=spec,
                                                    recv_input_ids=bool(kwargs.get("recv_input_ids", False)))
            except AFDError as e:
                _end_loop_if_stopped(self, e)
                raise

        def send_ffn_output(self, ffn_output: torch.Tensor, context: Any, **kwargs: Any) -> None:
            """Split-back of ``ffn_output`` ``[total, hidden_size]`` by the context's per-peer rows.

            Raises:
                SystemExit: on afd-plugin's FFN loop thread only, after an orderly close
                    (see ``recv_dp_metadata_list``); AFDError: see afd_ext's ``send_ffn_output``.
            """
            try:
                self._inner.send_ffn_output(ffn_output, context)
            except AFDError as e:
                _end_loop_if_stopped(self, e)
                raise

        def __repr__(self) -> str:
            return f"AfdExtAFDConnector({self._inner!r})"


def __getattr__(name: str) -> Any:
    if name in ("AfdExtAFDConnector", "AfdExtExtraInfo"):
        raise ImportError(f"{name} needs the reference plugin: afd_plugin is not importable ({_IMPORT_ERROR})")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
