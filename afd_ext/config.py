"""AFD configuration: the reference's fields and aliases, plus our connector's typed extra config.

Pure Python (no torch). :class:`AFDConfig` parses what a vLLM user passes as
``--additional-config '{"afd": {...}}'`` to the reference plugin: the same
fields, aliases, coercion rules and errors. ``connector_extra_config`` is an
envelope handed to the connector; for our connector (``"AfdExtConnector"``,
or the reference's name ``"P2pNcclAFDConnector"``, which maps to it) it is
parsed into :class:`AfdExtConnectorConfig` up front, so a typo fails at
configuration time, not at the first step.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from .errors import AFDConfigError, AFDTypeError

#: Fields of ``connector_extra_config`` that once chose the packed wire format (removed: one message
#: per tensor won at every size in CUDA graphs, docs/benchmarks.md); still accepted, with a warning.
_DEPRECATED_EXTRA = ("wire_format", "packed_max_bytes")

#: Our connector's registry name.
DEFAULT_CONNECTOR = "AfdExtConnector"
#: The reference's connector name; accepted as an alias of ours.
REFERENCE_CONNECTOR = "P2pNcclAFDConnector"
BUILTIN_CONNECTOR_NAMES = (DEFAULT_CONNECTOR, REFERENCE_CONNECTOR)

#: Transports ``connector_extra_config.transport`` can name (besides ``"auto"``): name -> ``"module:Class"``,
#: imported on first use by :mod:`afd_ext.transport`; :func:`afd_ext.transport.register_transport` adds to it.
#: Plain strings here, so configuration stays free of torch and below the transports.
TRANSPORTS: dict[str, str] = {
    "nccl": "afd_ext.transport.nccl:NcclTransport",
    "gloo": "afd_ext.transport.gloo:GlooTransport",
    "peer": "afd_ext.transport.peer:PeerTransport",
}

_ROLES = ("attention", "ffn")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def coerce_bool(value: Any, name: str) -> bool:
    """The reference's bool rule: a bool, 0/1, or "1/true/yes/on" / "0/false/no/off".

    Raises:
        AFDTypeError (a TypeError): anything else.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
    raise AFDTypeError(f"{name} must be a bool (true/false, 1/0, yes/no, on/off), got {value!r}")


def coerce_int(value: Any, name: str) -> int:
    """An int, or a string of decimal digits; bools and floats are rejected.

    Raises:
        AFDTypeError (a TypeError): anything else.
    """
    if isinstance(value, bool) or isinstance(value, float):
        raise AFDTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        v = value.strip()
        if v.lstrip("+-").isdigit() and v.isascii():
            return int(v)
    raise AFDTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def coerce_float(value: Any, name: str) -> float:
    """An int, a float or a numeric string; bools, NaN and infinities are rejected.

    Raises:
        AFDTypeError (a TypeError): not a number. AFDConfigError: not finite.
    """
    bad = AFDTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad
    try:
        out = float(value)  # a string may carry spaces around the number
    except ValueError:
        raise bad from None
    if not math.isfinite(out):
        raise AFDConfigError(f"{name} must be finite, got {value!r}")
    return out


def resolve_job_id(explicit: Any = None) -> tuple[str, str]:
    """This AFD job's identity and where it came from, as ``(job_id, source)``.

    Order: ``explicit`` (``connector_extra_config.job_id``), the ``AFD_JOB_ID``
    environment variable, torchrun's ``TORCHELASTIC_RUN_ID`` (its rendezvous
    id), else ``""`` (no identity: the store then refuses only a rank whose
    world rank a live process holds).

    Raises:
        AFDTypeError (a TypeError): ``explicit`` is neither None nor a string.
    """
    if explicit is not None:
        if not isinstance(explicit, str):
            raise AFDTypeError(f"connector_extra_config.job_id must be a string, got {type(explicit).__name__}")
        return explicit.strip(), "connector_extra_config.job_id"
    from . import envs

    env = envs.get("AFD_JOB_ID")
    if env:
        return env.strip(), "AFD_JOB_ID"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id:
        return run_id, "TORCHELASTIC_RUN_ID"
    return "", "default (no job identity)"


def _one_of(value: Any, name: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise AFDConfigError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


# ---------------------------------------------------------------------------
# Our connector's extra config
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AfdExtConnectorConfig:
    """Typed ``connector_extra_config`` of ``AfdExtConnector``.

    Every field is optional in the mapping; see ``docs/configuration.md``.

    Attributes:
        strict: put a header (layer, stage, tensor, dtype, rows) on every
            message and check it on receipt.
        clamp_idle_to_one: reference compatibility: a zero token count is
            treated as one (the runtime runs a one-token dummy batch).
        init_timeout_s: rendezvous / connector init deadline, seconds
            (generous: the FFN side may load a large model first).
        step_timeout_s: deadline of one in-flight operation or host wait
            inside a step, seconds.
        heartbeat_interval_s: how often an idle peer says it is alive, seconds.
        heartbeat_timeout_s: silence after which a peer is declared dead, seconds.
        transport: ``"nccl"`` (CUDA tensors), ``"gloo"`` (CPU tensors), ``"peer"``
            (CUDA tensors written straight into the peer's memory over CUDA IPC,
            one node; docs/peer-memory.md) or ``"auto"`` (gloo for a CPU device;
            peer when every rank opens every peer's memory and a flag round trip
            succeeds; NCCL otherwise), or a name given to
            :func:`afd_ext.transport.register_transport`.
        control_channel: ``"auto"`` (shared memory on one host, else TCP),
            ``"shm"`` or ``"tcp"``.
        max_stages: most stages per step (checked at handshake and per step).
        graph_cache_size: most CUDA graphs / graph buffer sets kept per rank.
        peer_max_tokens: peer transport: most tokens one attention rank sends in
            one stage of a step through peer memory (sizes the buffers; vLLM's
            ``max_num_batched_tokens`` is the natural value).
        peer_stages: peer transport: stages per step the buffers hold.
        peer_fallback: peer transport: also build NCCL communicators and send
            steps beyond ``peer_max_tokens`` / ``peer_stages`` over them (off:
            such a step is an error).
        hidden_wire_dtype: None (the hidden dtype travels) or ``"fp8_e4m3"``: attention -> FFN
            hidden states travel as FP8 values + one float32 scale per 128 channels
            (docs/fp8.md; bf16 hidden states, hidden size a multiple of 128). Both roles must agree.
        fp8_delivery: with FP8 on the wire, what ``recv_attn_output`` returns on an FFN rank:
            ``"dequant"`` (bf16, dequantized in the fan-in) or ``"fp8"`` (the values, and the
            scales in ``payload.hidden_scales``).
        fp8_scale_format: with FP8 on the wire, its scales: ``"fp32"`` (``amax / 448``) or ``"ue8m0"``
            (that rounded up to a power of two, DeepEP's ``round_scale``; docs/fp8.md). Both roles must agree.
        job_id: identity of this AFD job; the rendezvous store refuses a rank of
            another job (:class:`~afd_ext.errors.JobMismatchError`). Default
            (None): :func:`resolve_job_id` (``AFD_JOB_ID``, then torchrun's
            ``TORCHELASTIC_RUN_ID``, else ``""``: no identity).
    """

    strict: bool = False
    clamp_idle_to_one: bool = False
    init_timeout_s: float = 600.0
    step_timeout_s: float = 60.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    transport: str = "auto"
    control_channel: str = "auto"
    max_stages: int = 4
    graph_cache_size: int = 32
    peer_max_tokens: int = 8192
    peer_stages: int = 2
    peer_fallback: bool = True
    hidden_wire_dtype: str | None = None
    fp8_delivery: str = "dequant"
    fp8_scale_format: str = "fp32"
    job_id: str | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        set_("job_id", resolve_job_id(self.job_id)[0])
        _one_of(self.transport, "connector_extra_config.transport", (*TRANSPORTS, "auto"))
        _one_of(self.control_channel, "connector_extra_config.control_channel", ("auto", "shm", "tcp"))
        if self.hidden_wire_dtype is not None:
            _one_of(self.hidden_wire_dtype, "connector_extra_config.hidden_wire_dtype", ("fp8_e4m3",))
        _one_of(self.fp8_delivery, "connector_extra_config.fp8_delivery", ("dequant", "fp8"))
        _one_of(self.fp8_scale_format, "connector_extra_config.fp8_scale_format", ("fp32", "ue8m0"))
        if self.fp8_scale_format != "fp32" and self.hidden_wire_dtype is None:
            raise AFDConfigError(f"connector_extra_config.fp8_scale_format {self.fp8_scale_format!r} sets the scales of "
                                 "FP8 hidden states; set hidden_wire_dtype 'fp8_e4m3' too, or drop it")
        for name in ("strict", "clamp_idle_to_one", "peer_fallback"):
            set_(name, coerce_bool(getattr(self, name), f"connector_extra_config.{name}"))
        for name, lo in (("max_stages", 1), ("graph_cache_size", 0), ("peer_max_tokens", 1),
                         ("peer_stages", 1)):
            v = coerce_int(getattr(self, name), f"connector_extra_config.{name}")
            if v < lo:
                raise AFDConfigError(f"connector_extra_config.{name} must be >= {lo}, got {v}")
            set_(name, v)
        for name in ("init_timeout_s", "step_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s"):
            v = coerce_float(getattr(self, name), f"connector_extra_config.{name}")
            if v <= 0:
                raise AFDConfigError(f"connector_extra_config.{name} must be > 0 seconds, got {v}")
            set_(name, v)
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise AFDConfigError(
                f"connector_extra_config.heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be larger "
                f"than heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        if self.hidden_wire_dtype is not None and self.strict:
            raise AFDConfigError("connector_extra_config.hidden_wire_dtype 'fp8_e4m3' does not combine with strict "
                                 "(its headers describe the unquantized tensors); turn one off")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> "AfdExtConnectorConfig":
        """Parse a ``connector_extra_config`` mapping (``None`` or empty: defaults).

        ``wire_format`` / ``packed_max_bytes`` (the removed packed wire format) are ignored with a
        ``DeprecationWarning``.

        Raises:
            AFDTypeError (a TypeError): ``raw`` is not a mapping, or a value has the wrong type.
            AFDConfigError: unknown key (the message lists the known ones) or a
                value out of range.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise AFDTypeError("connector_extra_config must be a mapping")
        old = [k for k in _DEPRECATED_EXTRA if k in raw]
        if old:
            warnings.warn(f"connector_extra_config field(s) {old} are deprecated and ignored: the packed wire "
                          "format was removed (every wire tensor travels as its own message); drop them",
                          DeprecationWarning, stacklevel=2)
            raw = {k: v for k, v in raw.items() if k not in _DEPRECATED_EXTRA}
        known = [f.name for f in fields(cls)]
        unknown = sorted(k for k in raw if k not in known)
        if unknown:
            raise AFDConfigError(
                f"unknown connector_extra_config field(s) {unknown} for {DEFAULT_CONNECTOR}; "
                f"known fields: {known}"
            )
        return cls(**dict(raw))

    def to_mapping(self) -> dict[str, Any]:
        """All fields as a plain dict (round-trips through :meth:`from_mapping`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ---------------------------------------------------------------------------
# AFDConfig
# ---------------------------------------------------------------------------

# the reference's other spelling of a field -> the field (every field is also accepted by its own name)
_ALIASES = {"afd_connector": "connector", "async": "async_dp", "afd_role": "role", "afd_port": "port",
            "afd_host": "host"}


@dataclass(frozen=True)
class AFDConfig:
    """AFD configuration, field-compatible with the reference's ``AFDConfig``.

    Attributes:
        connector: registry name (alias ``afd_connector``); default ours,
            ``"P2pNcclAFDConnector"`` maps to ours, third-party names are
            resolved by the factory.
        async_dp: asynchronous DP connector (alias ``async``); ours is synchronous.
        role: ``"attention"`` or ``"ffn"`` (alias ``afd_role``).
        port: rendezvous port on ``host`` (alias ``afd_port``), 1..65535.
        host: host of FFN rank 0, which serves the rendezvous store (alias ``afd_host``).
        num_attention_ranks: ``A`` >= 1 (attention worker processes, DP x TP).
        num_ffn_ranks: ``F`` >= 1.
        compute_gate_on_attention: the attention side computes router logits
            and sends them; only MoE layers go to the FFN side.
        connector_extra_config: connector-owned mapping (see
            :class:`AfdExtConnectorConfig` for ours).
        extra: the parsed extra config of our connector (``None`` for a
            third-party connector). Not a constructor argument.

    Raises:
        AFDConfigError (a ValueError) / TypeError: see :meth:`from_dict`.
    """

    connector: str = DEFAULT_CONNECTOR
    async_dp: bool = False
    role: str = "attention"
    port: int = 1239
    host: str = "127.0.0.1"
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    compute_gate_on_attention: bool = False
    connector_extra_config: Mapping[str, Any] = field(default_factory=dict, hash=False)  # a dict: not hashed
    extra: AfdExtConnectorConfig | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        if not isinstance(self.connector, str) or not self.connector.strip():
            raise AFDConfigError(f"connector must be a non-empty connector name, got {self.connector!r}")
        set_("async_dp", coerce_bool(self.async_dp, "async_dp"))
        set_("compute_gate_on_attention", coerce_bool(self.compute_gate_on_attention, "compute_gate_on_attention"))
        if self.role not in _ROLES:
            raise AFDConfigError(f"unknown AFD role {self.role!r}; expected 'attention' or 'ffn'")
        if self.async_dp and self.connector in BUILTIN_CONNECTOR_NAMES:
            raise AFDConfigError(
                f"async_dp=True requires an asynchronous connector; {self.connector} is synchronous "
                "(set async_dp to false or choose an asynchronous connector)"
            )
        if not isinstance(self.host, str) or not self.host.strip():
            raise AFDConfigError(f"host must be a non-empty host name or address, got {self.host!r}")
        port = coerce_int(self.port, "port")
        if not 0 < port < 65536:
            raise AFDConfigError(f"port must be in 1..65535, got {port}")
        set_("port", port)
        for name in ("num_attention_ranks", "num_ffn_ranks"):
            v = coerce_int(getattr(self, name), name)
            if v <= 0:
                raise AFDConfigError(f"{name} must be positive, got {v}")
            set_(name, v)
        extra = {} if self.connector_extra_config is None else self.connector_extra_config
        if not isinstance(extra, Mapping):
            raise AFDTypeError("connector_extra_config must be a mapping")
        set_("connector_extra_config", dict(extra))
        if self.connector in BUILTIN_CONNECTOR_NAMES:
            set_("extra", AfdExtConnectorConfig.from_mapping(extra))

    # -- parsing ---------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, expected_role: str | None = None) -> "AFDConfig":
        """Parse a mapping that may use the reference's aliases.

        Args:
            raw: the ``"afd"`` section, e.g. ``{"afd_role": "ffn", "num_attention_ranks": 2}``.
            expected_role: when given, the parsed role must equal it.

        Raises:
            AFDTypeError (a TypeError): ``raw`` or ``connector_extra_config`` not a mapping, a
                bool/int field of the wrong type.
            AFDConfigError: unknown field ("put connector-specific values under
                'connector_extra_config'"), a field given under two spellings,
                role mismatch, port out of range, non-positive counts, a bad
                extra config.
        """
        if not isinstance(raw, Mapping):
            raise AFDTypeError(f"AFD config must be a mapping, got {type(raw).__name__}")
        seen: dict[str, str] = {}
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            canon = _SPELLING_TO_FIELD.get(key)
            if canon is None:
                raise AFDConfigError(
                    f"unknown AFD config field {key!r}; put connector-specific values under "
                    f"'connector_extra_config' (known fields: {sorted(_SPELLING_TO_FIELD)})"
                )
            if canon in seen:
                raise AFDConfigError(f"duplicate AFD config field {canon!r}: given as both {seen[canon]!r} and {key!r}")
            seen[canon] = key
            kwargs[canon] = value
        if "connector_extra_config" in kwargs and not isinstance(kwargs["connector_extra_config"], Mapping):
            raise AFDTypeError("connector_extra_config must be a mapping")
        cfg = cls(**kwargs)
        if expected_role is not None and cfg.role != expected_role:
            raise AFDConfigError(f"AFD config role is {cfg.role!r} but this process runs the {expected_role!r} role")
        return cfg

    @classmethod
    def from_json(cls, text: str | bytes, *, expected_role: str | None = None) -> "AFDConfig":
        """Parse JSON text: either the ``"afd"`` section or a whole additional config ``{"afd": {...}}``.

        Raises:
            AFDConfigError: invalid JSON, plus everything :meth:`from_dict` raises.
        """
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise AFDConfigError(f"AFD config is not valid JSON: {e}") from None
        if isinstance(doc, Mapping) and set(doc) == {"afd"}:
            doc = doc["afd"]
        return cls.from_dict(doc, expected_role=expected_role)

    def to_dict(self) -> dict[str, Any]:
        """Canonical field names -> values (round-trips through :meth:`from_dict`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init} | {
            "connector_extra_config": dict(self.connector_extra_config)
        }

    # -- reference properties ------------------------------------------------------

    @property
    def afd_connector(self) -> str:
        return self.connector

    @property
    def afd_role(self) -> str:
        return self.role

    @property
    def afd_port(self) -> int:
        return self.port

    @property
    def afd_host(self) -> str:
        return self.host

    @property
    def is_attention_server(self) -> bool:
        return self.role == "attention"

    @property
    def is_ffn_server(self) -> bool:
        return self.role == "ffn"

    def compute_hash(self) -> str:
        """sha256 hex of ``[connector, async_dp, role, A, F]`` (the reference's fields)."""
        factors = [self.connector, self.async_dp, self.role, self.num_attention_ranks, self.num_ffn_ranks]
        return hashlib.sha256(str(factors).encode()).hexdigest()

    def extra_config(self) -> AfdExtConnectorConfig:
        """Our connector's typed extra config (defaults for a third-party connector's name).

        Raises:
            AFDConfigError: the connector is a third-party one and its extra config
                does not parse as ours.
        """
        return self.extra if self.extra is not None else AfdExtConnectorConfig.from_mapping(self.connector_extra_config)


_SPELLING_TO_FIELD = {f.name: f.name for f in fields(AFDConfig) if f.init} | _ALIASES


def _additional_config(source: Any) -> Mapping[str, Any] | None:
    """``source`` itself when it is a mapping, else its ``additional_config`` (a vLLM ``VllmConfig``)."""
    if source is None or isinstance(source, Mapping):
        return source
    if not hasattr(source, "additional_config"):
        raise AFDTypeError(
            f"expected vLLM's additional_config mapping or a VllmConfig-like object with an "
            f"additional_config attribute, got {type(source).__name__}"
        )
    extra = source.additional_config
    if extra is not None and not isinstance(extra, Mapping):
        raise AFDTypeError(f"additional_config must be a mapping, got {type(extra).__name__}")
    return extra


def has_afd_config(source: Any) -> bool:
    """True when ``source`` (``additional_config`` or a ``VllmConfig``) has an ``"afd"`` section."""
    extra = _additional_config(source)
    return isinstance(extra, Mapping) and "afd" in extra


def parse_afd_config(source: Any, *, expected_role: str | None = None) -> AFDConfig:
    """Parse ``additional_config["afd"]``.

    Args:
        source: vLLM's ``additional_config`` mapping, or a ``VllmConfig``-like
            object whose ``additional_config`` holds it (what the reference's
            runners pass).

    Raises:
        AFDConfigError: no ``"afd"`` section, plus everything :meth:`AFDConfig.from_dict` raises.
        AFDTypeError (a TypeError): ``source`` is neither a mapping nor has ``additional_config``.
    """
    extra = _additional_config(source)
    if not (isinstance(extra, Mapping) and "afd" in extra):
        raise AFDConfigError(
            'AFD is not configured: additional_config has no "afd" section '
            "(pass --additional-config '{\"afd\": {...}}' to vLLM)"
        )
    return AFDConfig.from_dict(extra["afd"], expected_role=expected_role)


def parse_optional_afd_config(source: Any, *, expected_role: str | None = None) -> AFDConfig | None:
    """Like :func:`parse_afd_config`, but ``None`` when there is no ``"afd"`` section."""
    if not has_afd_config(source):
        return None
    return parse_afd_config(source, expected_role=expected_role)
