"""Opening a rank's control channels, and the control plane the connector uses."""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Any, Callable, Mapping

from afd_ext import rendezvous as rdzv
from afd_ext.errors import AFDConfigError, AFDStateError, ControlChannelClosed, ControlProtocolError
from afd_ext.rendezvous import AFDStore

from .channel import (
    CHANNEL_KINDS,
    _OP_RECV,
    ChannelOptions,
    ControlChannel,
    logger,
)
from .shm import ShmControlChannel
from .tcp import TcpControlChannel


# ---------------------------------------------------------------------------
# Opening the channels of one rank
# ---------------------------------------------------------------------------


def _normalise_role(role: Any) -> str:
    r = getattr(role, "value", role)
    r = str(r).lower()
    if r not in ("attention", "ffn"):
        raise AFDConfigError(f"role must be 'attention' or 'ffn', got {role!r}")
    return r


def _store_abort_check(store: AFDStore | None) -> Callable[[str], None] | None:
    if store is None:
        return None
    return lambda op: rdzv.raise_if_aborted(store, op=op)


def open_control_channels(
    store: AFDStore,
    topology: Any,
    role: str,
    role_rank: int,
    kind: str = "auto",
    timeout_s: float | None = None,
    *,
    options: ChannelOptions | None = None,
) -> dict[int, ControlChannel]:
    """Open this rank's control channels (collective over the control senders and FFN ranks).

    Attention rank ``a`` gets one sending channel per FFN rank in
    ``topology.control_destinations(a)`` (none when it is not a sender); FFN
    rank ``f`` gets one receiving channel from ``topology.control_source(f)``.
    Ranks without channels return at once.

    Args:
        store: this generation's store (:func:`afd_ext.rendezvous.connect`).
        topology: an :class:`afd_ext.topology.Topology`.
        role: ``"attention"`` or ``"ffn"``.
        role_rank: this rank inside its role.
        kind: ``"auto"`` (shm when both ends share a host, else tcp), ``"shm"`` or ``"tcp"``.
        timeout_s: deadline for the whole setup in seconds (None: the store's default).
        options: channel tuning (default :meth:`ChannelOptions.from_env`).

    Returns:
        peer role rank (FFN rank for a sender, attention rank for a receiver) -> channel.

    Raises:
        AFDConfigError: unknown ``kind`` or role, or the two ends chose different kinds.
        RendezvousTimeoutError: a peer did not show up in time (named).
        RuntimeError: ``shm`` forced across hosts.
        StepAbortedError: an abort was posted meanwhile.
    """
    if kind not in CHANNEL_KINDS:
        raise AFDConfigError(f"control channel kind must be one of {CHANNEL_KINDS}, got {kind!r}")
    role = _normalise_role(role)
    opts = options or ChannelOptions.from_env()
    timeout = store.timeout_s if timeout_s is None else float(timeout_s)
    deadline = time.monotonic() + timeout
    F = topology.num_ffn_ranks
    me = topology.world_rank(role, role_rank)
    abort_check = _store_abort_check(store)
    if role == "attention":
        pairs = [(role_rank, f) for f in topology.control_destinations(role_rank)]
    else:
        pairs = [(topology.control_source(role_rank), role_rank)]
    if not pairs:
        return {}
    mine = rdzv.host_identity()
    store.set(f"ctrl/host/{me}", mine.encode("utf-8"))

    def pair_kind(a: int, f: int) -> str:
        if kind != "auto":
            return kind
        other = F + a if role == "ffn" else f
        rdzv.wait_for_keys(store, {f"ctrl/host/{other}": other}, deadline - time.monotonic(),
                           "the control channel host identity")
        theirs = store.get(f"ctrl/host/{other}").decode("utf-8")
        return "shm" if theirs == mine else "tcp"

    channels: dict[int, ControlChannel] = {}
    try:
        if role == "ffn":
            (a, f), = pairs
            peer_rank = F + a
            peer = store.label(peer_rank) if store.num_ffn_ranks else rdzv.rank_label(peer_rank, F)
            k = pair_kind(a, f)
            base = f"ctrl/{a}/{f}"
            store.set(f"{base}/kind", k.encode("utf-8"))
            if k == "shm":
                prefix = f"afd-{os.getpid()}-{store.generation_key}-{a}-{f}"
                ch = ShmControlChannel.create(prefix, local_rank=me, peer_rank=peer_rank, peer=peer,
                                              options=opts, abort_check=abort_check)
                try:
                    store.set(f"{base}/shm", ch.name.encode("utf-8"))
                    ch.wait_attached(deadline, store)
                except BaseException:
                    ch.close()
                    raise
                channels[a] = ch
            else:
                ls = TcpControlChannel.listen(store)
                try:
                    host, port = ls.getsockname()[:2]
                    token = secrets.token_bytes(16)
                    store.set(f"{base}/tcp", json.dumps(
                        {"host": host, "port": port, "token": token.hex()}).encode("utf-8"))
                    channels[a] = TcpControlChannel.accept(
                        ls, deadline, local_rank=me, peer_rank=peer_rank, peer=peer,
                        options=opts, abort_check=abort_check, store=store, token=token)
                finally:
                    ls.close()
        else:
            for a, f in pairs:
                peer_rank = f
                peer = rdzv.rank_label(peer_rank, F)
                k = pair_kind(a, f)
                base = f"ctrl/{a}/{f}"
                rdzv.wait_for_keys(store, {f"{base}/kind": peer_rank}, deadline - time.monotonic(),
                                   f"the control channel of {peer}")
                theirs = store.get(f"{base}/kind").decode("utf-8")
                if theirs != k:
                    msg = (f"control channel kind mismatch: {peer} opened a {theirs!r} channel, "
                           f"{store.label()} expects {k!r}; set connector_extra_config.control_channel "
                           "to the same value on every rank (or 'auto')")
                    rdzv.post_abort(store, msg)  # the FFN end stops waiting for us at once
                    raise AFDConfigError(msg)
                rdzv.wait_for_keys(store, {f"{base}/{k}": peer_rank}, deadline - time.monotonic(),
                                   f"the {k} control channel of {peer}")
                info = store.get(f"{base}/{k}").decode("utf-8")
                if k == "shm":
                    channels[f] = ShmControlChannel.attach(info, local_rank=me, peer_rank=peer_rank, peer=peer,
                                                           options=opts, abort_check=abort_check)
                else:
                    d = json.loads(info)
                    channels[f] = TcpControlChannel.connect(
                        (d["host"], int(d["port"])), deadline, bytes.fromhex(d["token"]),
                        local_rank=me, peer_rank=peer_rank, peer=peer, options=opts, abort_check=abort_check)
    except BaseException:
        for ch in channels.values():
            ch.close()
        raise
    return channels


# ---------------------------------------------------------------------------
# Control plane
# ---------------------------------------------------------------------------


class AFDControlPlane:
    """The reference's DP-metadata control plane (``connector.control_plane``) over host channels.

    One object per connector, built device-light at construction and kept
    across ``close()`` / ``init_afd_connector()``: :meth:`open` opens this
    rank's channels (collective, at init), :meth:`close` releases them (the
    object can be opened again). No device synchronisation anywhere. While
    open, ``send_dp_metadata_list`` / ``recv_dp_metadata_list`` are instance
    attributes bound to the channel's fronts where it has them (the same
    contract; a subclass's or a patch's override of them is left in use).

    Args:
        apply_payload: ``apply_payload(payload)`` applies a payload to the
            connector (validates the step, builds its schedule); called by
            :meth:`update_state_from_dp_metadata`.
        topology: the :class:`~afd_ext.topology.Topology` (control routing).
        role: ``"attention"`` or ``"ffn"``; role_rank: this rank inside its role.
        channels: already opened channels (peer role rank -> channel, from
            :func:`open_control_channels`); None: call :meth:`open` later.
        store: the generation's store: its step-abort signal ends a waiting
            receive, and this rank posts it when a payload is malformed.
        recv_timeout_s: optional step timeout of :meth:`recv_dp_metadata_list`
            (None: wait as long as the sender's heartbeat is fresh).
        max_payload_bytes: bound on an incoming payload, in bytes.
        label: this rank's label in errors (default ``"<role> rank <role_rank>"``).
        check_send: ``check_send(payload)`` runs before every :meth:`send_dp_metadata_list`
            (the connector checks the payload sent matches the one applied); None: no check.

    Raises:
        AFDConfigError: unknown role, or ``channels`` do not match the topology's
            control routing.
    """

    def __init__(
        self,
        apply_payload: Callable[[Any], None],
        topology: Any,
        role: str,
        role_rank: int,
        channels: Mapping[int, ControlChannel] | None = None,
        *,
        store: AFDStore | None = None,
        recv_timeout_s: float | None = None,
        max_payload_bytes: int | None = None,
        label: str | None = None,
        check_send: Callable[[Any], None] | None = None,
    ):
        from afd_ext import metadata as md

        self._md = md
        self._apply = apply_payload
        self._check_send = check_send
        self.topology = topology
        self.role = _normalise_role(role)
        self.role_rank = role_rank
        self.label = label or f"{self.role} rank {role_rank}"
        self.recv_timeout_s = recv_timeout_s
        self.max_payload_bytes = max_payload_bytes or md.DEFAULT_MAX_CONTROL_BYTES
        if self.role == "attention":
            self.destinations: tuple[int, ...] = tuple(topology.control_destinations(role_rank))
            self.source: int | None = None
        else:
            self.destinations = ()
            self.source = topology.control_source(role_rank)
        self.channels: dict[int, ControlChannel] = {}
        self.store: AFDStore | None = None
        self._open = False
        self._recv_started: float | None = None  # the front's wait began (monotonic s), for its fallback
        if channels is not None:
            self.attach(channels, store=store)

    # -- lifecycle ----------------------------------------------------------------

    def open(self, store: AFDStore, kind: str = "auto", timeout_s: float | None = None, *,
             options: ChannelOptions | None = None) -> None:
        """Open this rank's control channels (collective over the control senders and FFN ranks).

        Args:
            store: this generation's store.
            kind: ``"auto"``, ``"shm"`` or ``"tcp"`` (see :func:`open_control_channels`).
            timeout_s: setup deadline in seconds (None: the store's default).
            options: channel tuning (default :meth:`ChannelOptions.from_env`).

        Raises:
            AFDStateError: already open.
            Whatever :func:`open_control_channels` raises (nothing is left open then).
        """
        if self._open:
            raise AFDStateError(f"the control plane of {self.label} is already open; close() it first")
        self.attach(open_control_channels(store, self.topology, self.role, self.role_rank, kind, timeout_s,
                                          options=options), store=store)

    def attach(self, channels: Mapping[int, ControlChannel], *, store: AFDStore | None = None) -> None:
        """Use already opened ``channels`` (peer role rank -> channel) and ``store``.

        Raises:
            AFDConfigError: the channels do not match the topology's control routing.
        """
        expected = set(self.destinations) if self.role == "attention" else {self.source}
        if set(channels) != expected:
            raise AFDConfigError(
                f"{self.label}: control channels to {sorted(channels)} do not match the topology's "
                f"control routing {sorted(expected)}; build them with open_control_channels"
            )
        self.channels = dict(channels)
        self.store = store
        self._open = True
        self._bind_fronts()

    def _bind_fronts(self) -> None:
        """Bind the per-step calls on this instance to the channel's fronts, where it has them
        (native, both ends, shm and tcp): the same calls, contract and errors
        as the methods below, so that a step after a long gap, on cold caches, runs no frame of this
        class on its way (the fronts fall back to :meth:`_send_checked` / :meth:`_recv_checked`).
        Not where a subclass or a patch replaced the class's method. :meth:`close` unbinds."""
        self._unbind_fronts()  # a re-attach: the previous channels' fronts must not stay
        md = self._md
        front = None
        if len(self.destinations) == 1 and type(self).send_dp_metadata_list is _CLASS_SEND:
            front = self.channels[self.destinations[0]].send_front(self._check_send, self._send_checked)
            if front is not None:
                setattr(self, "send_dp_metadata_list", front)
        elif self.role == "ffn" and type(self).recv_dp_metadata_list is _CLASS_RECV:
            front = self.channels[self.source].take_front(  # type: ignore[index]
                md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS, self._first_slice_ns, self._recv_checked)
            if front is not None:
                setattr(self, "recv_dp_metadata_list", front)

    def _unbind_fronts(self) -> None:
        for name in ("send_dp_metadata_list", "recv_dp_metadata_list"):  # the class's methods again
            if name in vars(self):
                delattr(self, name)

    @property
    def is_open(self) -> bool:
        """Whether the channels are open (between :meth:`open` and :meth:`close`)."""
        return self._open

    @property
    def is_sender(self) -> bool:
        """Whether this rank sends control payloads (attention rank ``< min(A, F)``)."""
        return bool(self.destinations)

    def close(self) -> None:
        """Close every channel (idempotent; a sender's close tells its FFN ranks). :meth:`open` may follow."""
        channels, self.channels = self.channels, {}
        self._open = False
        self._unbind_fronts()
        self.store = None
        for ch in channels.values():
            try:
                ch.close()
            except Exception as e:  # noqa: BLE001 - close must not raise
                logger.warning("closing control channel to %s: %s", ch.peer, e)

    def _require_open(self, op: str) -> None:
        if not self._open:
            raise AFDStateError(
                f"AFD connector ({self.label}) is not initialized; call init_afd_connector() before {op}"
            )

    # -- the reference's three calls ------------------------------------------------

    def update_state_from_dp_metadata(self, payload: Any) -> None:
        """Apply ``payload`` locally (no network): validate the step, build its schedule.

        Attention ranks call it before :meth:`send_dp_metadata_list` every step;
        FFN ranks after :meth:`recv_dp_metadata_list`.

        Raises:
            Whatever ``apply_payload`` raises for an invalid step or a wrong state.
        """
        self._apply(payload)

    def send_dp_metadata_list(self, payload: Any) -> None:
        """Send ``payload`` to this attention rank's control destinations (a no-op on non-senders).

        With one destination, :meth:`open` binds this name on the instance to the channel's front
        (:meth:`ControlChannel.send_front`; shm: ``check_send``, then one C call that encodes and
        publishes a plain payload); the rest goes through the checked path.

        Args:
            payload: an :class:`~afd_ext.metadata.AFDControlPayload`.

        Raises:
            AFDStateError: not open (connector not initialised).
            AFDConfigError: not a valid control payload, or larger than the channel's limit.
            PeerDeadError: a destination FFN rank is gone.
        """
        if not self._open:
            self._require_open("send_dp_metadata_list")
        if self._check_send is not None:
            self._check_send(payload)
        self._send_checked(payload)

    def _send_checked(self, payload: Any) -> None:
        """The checked send of a payload that passed ``check_send`` (also the native front's path
        for whatever it declined): waits for ring space, names a bad value or a closed plane."""
        if not self._open:
            self._require_open("send_dp_metadata_list")
        dests = self.destinations
        if len(dests) == 1:  # the channel tries its one native call first
            self.channels[dests[0]].send_payload(payload)
            return
        if not dests:
            return
        parts = self._md.control_payload_parts(payload)  # checked once, before anything moves
        for f in dests:
            self.channels[f].send_parts(parts)

    def recv_dp_metadata_list(self) -> Any:
        """FFN side: block until the next step's payload arrives; return it decoded.

        With the compiled core, :meth:`open` binds this name on the instance to the channel's
        native front (:meth:`ControlChannel.take_front`): the wait's first slice (up to
        ``_FIRST_SLICE_S``, bounded by ``idle_s`` and ``recv_timeout_s``) is one C call that returns
        a payload arriving within it straight to the caller; otherwise the checked path carries on,
        the step timeout counted from the start of the wait.

        Returns:
            A new :class:`~afd_ext.metadata.AFDControlPayload` (the counts are CPU
            int32 tensors on access, as the reference's runners read them).

        Raises:
            AFDStateError: called on an attention rank, or not open.
            PeerDeadError: the source attention rank died (its heartbeat stopped).
            ControlChannelClosed: the source closed its channel (clean shutdown).
            ControlRecvTimeout: ``recv_timeout_s`` passed.
            StepAbortedError: some rank posted the step-abort signal.
            ControlProtocolError: a malformed payload or frame (names the source);
                the step-abort signal is posted first, so every rank stops at once.
        """
        self._recv_started = None
        return self._recv_checked(None)

    def _first_slice_ns(self) -> int:
        """The native front's first step: note when the wait began; the slice's length in ns."""
        self._recv_started = time.monotonic()
        ch = self.channels.get(self.source) if self._open else None  # type: ignore[arg-type]
        if ch is None:
            return 0  # closed: the checked path names it
        md = self._md
        return ch.first_slice_ns(self.recv_timeout_s, md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS,
                                 self.max_payload_bytes)

    def _recv_checked(self, taken: Any) -> Any:
        """The checked receive (also the native front's path after its first slice): ``taken`` is
        what that slice took and could not return (bytes: a message it could not build, consumed;
        an int or None: nothing). Waits on, checks and decodes; names every error."""
        started, self._recv_started = self._recv_started, None
        if self.role != "ffn":
            raise AFDStateError(f"recv_dp_metadata_list is called on FFN ranks only; this is {self.label}")
        if not self._open:
            self._require_open(_OP_RECV)
        md = self._md
        ch = self.channels[self.source]  # type: ignore[index]
        data = taken if type(taken) is bytes else None
        try:
            if data is None:
                data = ch.recv_payload(self.recv_timeout_s, _OP_RECV, md.DEFAULT_MAX_STAGES, md.DEFAULT_MAX_RANKS,
                                       self.max_payload_bytes, started)
            if type(data) is not bytes:  # built by the native path (checked as the decoder checks)
                return data
            try:
                if len(data) > self.max_payload_bytes:
                    raise ControlProtocolError(f"{len(data)} bytes exceed max_payload_bytes={self.max_payload_bytes}")
                return md.decode_control_binary(data)
            except ValueError as e:
                raise ControlProtocolError(f"{_OP_RECV}: malformed control payload from {ch.peer}: {e}") from None
        except ControlProtocolError as e:
            if self.store is not None:
                rdzv.post_abort(self.store, str(e))
            raise
        except ControlChannelClosed:
            if self.store is not None:  # a sender that aborted the step closes its channel: report the cause
                self.store.abort_signal.check(_OP_RECV)  # a lost store reads as no abort: the close stands
            raise


# The class's own per-step methods: _bind_fronts binds a front only where they are the ones in use.
_CLASS_SEND = AFDControlPlane.send_dp_metadata_list
_CLASS_RECV = AFDControlPlane.recv_dp_metadata_list

#: The name of the channel-based implementation before it became the one class.
ChannelControlPlane = AFDControlPlane
