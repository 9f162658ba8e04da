"""The control plane's message codecs: an AFDControlPayload to bytes and back.

* :func:`encode_control_payload` / :func:`decode_control_payload`: the reference's JSON
  (``afd_plugin.connectors.metadata``'s codec) plus a ``format_version`` (``CONTROL_FORMAT_VERSION``;
  a payload without one is read as the reference's format, version 1); the reference-format API (the
  reference's own two-message framing is rebuilt where it is measured, ``afd_ext.tools.bench.control``).
* :func:`encode_control_binary` / :func:`decode_control_binary`: the compact binary layout the
  channels carry between two ``afd_ext`` ranks, native (``csrc/control_bindings.cpp``).

Both decoders bound their input (size, stages, ranks) and check every value; every failure is a
``ControlProtocolError`` (a ``ValueError``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import AFDConfigError, ControlProtocolError
from ..metadata import _FLAG_NAMES, AFDControlPayload, AFDDPMetadata

#: The control-payload format this package writes. Version 1 is the
#: reference's format (no ``format_version`` key, flags ``is_graph_capturing``
#: and ``is_warmup``, optionally ``is_graph_replaying`` and ``is_profile``).
#: Version 2 adds the ``format_version`` key and always writes all four flags.
CONTROL_FORMAT_VERSION = 2
REFERENCE_FORMAT_VERSION = 1

#: Default bound on an encoded control payload, in bytes. A payload for 2
#: stages and 4096 ranks of 10-digit counts is about 90 KB.
DEFAULT_MAX_CONTROL_BYTES = 1 << 20
#: Default bound on the number of stages in one payload.
DEFAULT_MAX_STAGES = 64
#: Default bound on the number of DP ranks in one stage's count vector.
DEFAULT_MAX_RANKS = 4096

_STAGE_KEY_RE = re.compile(r"0|[1-9][0-9]{0,8}")


def _canonical(payload: Any) -> AFDControlPayload:
    """``payload`` checked again and rebuilt for the codecs: a new :class:`AFDControlPayload` of
    :class:`AFDDPMetadata` values (a payload may have been changed after construction; any object with
    the payload's fields, the reference plugin's own class included, is read by
    :meth:`AFDControlPayload.from_fields`).

    Raises:
        AFDConfigError: no payload fields, a field missing, a non-bool flag, a stage key that is not an
            int >= 0, counts that cannot be converted.
    """
    payload = AFDControlPayload.from_fields(payload)
    try:
        flags = [getattr(payload, name) for name in _FLAG_NAMES]
        dp = payload.dp_metadata_list
    except AttributeError as e:
        raise AFDConfigError(f"control payload is missing a field: {e}") from None
    if not all(type(f) is bool for f in flags):
        raise AFDConfigError(f"control payload flags must be bools, got {tuple(flags)!r}")
    return AFDControlPayload(dp, *flags)  # checks the stage keys, converts the values


def encode_control_payload(payload: AFDControlPayload) -> bytes:
    """Encode ``payload`` as compact, key-sorted UTF-8 JSON, as the reference does.

    Layout (the reference's keys plus ``format_version``)::

        {"dp_metadata_list":{"<stage>":{"max_tokens_across_dp_cpu":<int>,
                                        "num_tokens_across_dp_cpu":[<int>,...]}},
         "format_version":2,"is_graph_capturing":<bool>,"is_graph_replaying":<bool>,
         "is_profile":<bool>,"is_warmup":<bool>}

    The bytes are ``json.dumps(doc, separators=(",", ":"), sort_keys=True)`` (stage keys sorted
    as strings). A reference decoder reads them (it ignores the keys it does not know).

    Args:
        payload: the control payload (or any object with its fields, read by
            :meth:`AFDControlPayload.from_fields`).

    Returns:
        The encoded bytes.

    Raises:
        AFDConfigError: ``payload`` has no payload fields, or was
            modified after construction into something invalid (a non-bool
            flag, a non-int stage key, invalid counts).
    """
    payload = _canonical(payload)
    doc: dict[str, Any] = {name: getattr(payload, name) for name in _FLAG_NAMES}
    doc["format_version"] = CONTROL_FORMAT_VERSION
    doc["dp_metadata_list"] = {
        str(s): {"max_tokens_across_dp_cpu": m.max_tokens, "num_tokens_across_dp_cpu": list(m.counts)}
        for s, m in payload.dp_metadata_list.items()
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def decode_control_payload(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_CONTROL_BYTES,
    max_stages: int = DEFAULT_MAX_STAGES,
    max_ranks: int = DEFAULT_MAX_RANKS,
) -> AFDControlPayload:
    """Decode JSON bytes written by :func:`encode_control_payload` or by the reference.

    A payload without ``format_version`` is the reference's format (version 1);
    keys this package does not know are ignored, as the reference does. The
    size is bounded before parsing, the stage and rank counts before any
    object is built, and every value is checked by the payload's constructors.
    Every call returns new objects holding the counts as ints (the tensors are
    built only if read). (Between two ``afd_ext`` ranks the control plane uses
    the binary :func:`encode_control_binary` instead.)

    Args:
        data: the encoded payload.
        max_bytes: largest accepted input, in bytes (checked before parsing).
        max_stages: largest accepted number of stages.
        max_ranks: largest accepted length of a stage's count vector.

    Returns:
        The payload (its ``num_tokens_across_dp_cpu`` / ``max_tokens_across_dp_cpu``
        are CPU int32 tensors on access).

    Raises:
        AFDConfigError: ``data`` is not bytes-like.
        ControlProtocolError: oversized input, invalid UTF-8 or JSON (including
            nesting too deep to parse), wrong types, negative or non-int32
            counts, too many stages or ranks, a non-canonical stage key, or an
            unknown ``format_version``. Both are ``ValueError``s.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise AFDConfigError(f"control payload must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ControlProtocolError(f"control payload of {len(data)} bytes exceeds max_bytes={max_bytes}; "
                                   "raise the limit on both sides if the topology really needs it")
    try:
        doc = json.loads(bytes(data).decode("utf-8"))
    except (ValueError, RecursionError) as e:  # not UTF-8 or JSON, nested too deeply, an int too long
        raise ControlProtocolError(f"control payload is not valid UTF-8 JSON: {e}") from None
    stages = doc.get("dp_metadata_list") if type(doc) is dict else None
    if type(stages) is not dict:
        raise ControlProtocolError("control payload must be a JSON object holding a dp_metadata_list JSON object")
    version = doc.get("format_version", REFERENCE_FORMAT_VERSION)
    if type(version) is not int or version not in (REFERENCE_FORMAT_VERSION, CONTROL_FORMAT_VERSION):
        raise ControlProtocolError(f"control payload format_version {version!r} is not supported; this afd_ext "
                                   "reads versions 1 and 2; run the same afd_ext version on every rank")
    if len(stages) > max_stages:
        raise ControlProtocolError(f"control payload: {len(stages)} stages exceed max_stages={max_stages}")
    dp = {}
    for key, entry in stages.items():
        entry = entry if type(entry) is dict else {}
        counts, mx = entry.get("num_tokens_across_dp_cpu"), entry.get("max_tokens_across_dp_cpu")
        if _STAGE_KEY_RE.fullmatch(key) is None or type(counts) is not list or type(mx) not in (int, type(None)):
            raise ControlProtocolError(f"control payload: dp_metadata_list[{key!r}] must be a canonical stage key "
                                       "(an int >= 0) of a JSON object holding a list num_tokens_across_dp_cpu "
                                       "and an int max_tokens_across_dp_cpu (or none)")
        if len(counts) > max_ranks:
            raise ControlProtocolError(f"control payload: dp_metadata_list[{key}] has {len(counts)} ranks, "
                                       f"exceeding max_ranks={max_ranks}")
        try:  # the constructor names the value; the stage is named here
            dp[int(key)] = AFDDPMetadata(counts, mx)
        except AFDConfigError as e:
            raise ControlProtocolError(f"control payload: dp_metadata_list[{key}]: {e}") from None
    try:
        return AFDControlPayload(dp, *(doc.get(name, False) for name in _FLAG_NAMES))
    except AFDConfigError as e:  # a flag: the constructor names it
        raise ControlProtocolError(f"control payload: {e}") from None


_new = object.__new__


def _native() -> Any:
    """The compiled core, whose control-plane functions hold the binary codec (``csrc/control_bindings.cpp``)."""
    from afd_ext import _C

    return _C


def _payload_of(fields: tuple) -> AFDControlPayload:
    """A new payload from the native decoder's checked fields:
    ``(is_graph_capturing, is_warmup, is_graph_replaying, is_profile, ((stage, max, counts), ...))``."""
    p = _new(AFDControlPayload)
    p.is_graph_capturing, p.is_warmup, p.is_graph_replaying, p.is_profile, stages = fields
    dp = p.dp_metadata_list = {}
    for s, mx, counts in stages:
        m = dp[s] = _new(AFDDPMetadata)
        m._counts, m._max = counts, mx
        m._t = m._tv = m._mt = m._mtv = m.local_sizes = None
    return p


def encode_control_binary(payload: AFDControlPayload) -> bytes:
    """Encode ``payload`` in the compact binary layout the control plane sends between afd_ext ranks.

    Layout, little-endian::

        b"AFDb" | version u8 (1) | flags u8 (bit 0 is_graph_capturing, 1 is_warmup,
        2 is_graph_replaying, 3 is_profile) | stages u16 |
        per stage, in increasing stage order:
            stage u32 | n u32 | max_tokens_across_dp_cpu u32 | counts int32[n]

    The codec is native (``csrc/control_bindings.cpp``, ``csrc/cpu/control_poll.cpp``); the control
    channels encode with it straight into their ring slot or frame. The reference cannot read it;
    :func:`encode_control_payload` (JSON) is the reference-format API.

    Args:
        payload: the control payload, or any object with its fields (the reference plugin's own
            class included; read by :meth:`AFDControlPayload.from_fields`).

    Returns:
        The encoded bytes (``8 + sum(12 + 4 * n)`` bytes).

    Raises:
        AFDConfigError: ``payload`` has no payload fields, or was
            modified after construction into something invalid (a non-bool
            flag, a stage key that is not an int in ``[0, 2**32)``, invalid
            counts, more than 65535 stages).
    """
    C = _native()
    data = C.ctrl_encode(payload)
    if data is None:  # not a payload the encoder takes as it is: convert it, or name what is wrong
        payload = _canonical(payload)
        data = C.ctrl_encode(payload)
        if data is None:  # what conversion cannot fix
            keys = sorted(payload.dp_metadata_list)
            raise AFDConfigError(f"a control payload holds at most 65535 stages, keyed by ints in [0, 2**32); "
                                 f"got {len(keys)} stages, the last {keys[-1]!r}")
    return data


def decode_control_binary(
    data: bytes | bytearray | memoryview,
    *,
    max_stages: int = DEFAULT_MAX_STAGES,
    max_ranks: int = DEFAULT_MAX_RANKS,
) -> AFDControlPayload:
    """Decode bytes written by :func:`encode_control_binary` (untrusted input; the native decoder
    bounds every length before it reads).

    Args:
        data: the encoded payload.
        max_stages: largest accepted number of stages.
        max_ranks: largest accepted length of a stage's count vector.

    Returns:
        A new :class:`AFDControlPayload` (counts held as ints; the CPU int32
        tensors are built on first access, as the reference's runners read them).

    Raises:
        AFDConfigError: ``data`` is not bytes-like.
        ControlProtocolError: wrong magic or version, unknown flag bits, truncated
            or trailing bytes, stages not strictly increasing, too many stages or
            ranks, negative or non-int32 counts. Both are ``ValueError``s.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise AFDConfigError(f"control payload must be bytes, got {type(data).__name__}")
    fields = _native().ctrl_decode(data, max_stages, max_ranks)
    if type(fields) is str:
        raise ControlProtocolError(fields)
    return _payload_of(fields)
