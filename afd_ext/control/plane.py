"""Opening a rank's control channels, and the control plane the connector uses."""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Any, Callable, Mapping

from afd_ext import rendezvous as rdzv
from afd_ext.errors import AFDConfigError, AFDStateError, ControlChannelClosed, ControlProtocolError, PeerDeadError
from afd_ext.health.process import start_time
from afd_ext.rendezvous import AFDStore

from .channel import CHANNEL_KINDS, _OP_RECV, ChannelOptions, ControlChannel, logger
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
        RendezvousError: ``shm`` between ranks that do not share ``/dev/shm`` (advises ``tcp``).
        PeerDeadError: the FFN rank created its shm segment, then exited or removed it during init.
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
                try:  # the pid lets the attaching end tell a dead FFN rank from a missing /dev/shm
                    store.set(f"{base}/shm", json.dumps({"name": ch.name, "pid": os.getpid(),
                                                          "start": start_time(os.getpid())}).encode("utf-8"))
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
                    channels[f] = _attach_shm(store, json.loads(info), mine, local_rank=me, peer_rank=peer_rank,
                                              peer=peer, options=opts, abort_check=abort_check)
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


def _attach_shm(store: AFDStore, info: dict, mine: str, **kw: Any) -> ShmControlChannel:
    """Attach the FFN rank's ring; a missing segment is named by its cause: an abort posted, the FFN
    rank gone (it created the segment, then failed or exited: its pid is checked on this host), or a
    ``/dev/shm`` these ranks do not share."""
    try:
        return ShmControlChannel.attach(info["name"], **kw)
    except FileNotFoundError:
        pass
    peer, what = kw["peer"], f"attaching the shared-memory control ring of {kw['peer']}"
    rdzv.raise_if_aborted(store, op=what)
    theirs = store.get(f"ctrl/host/{kw['peer_rank']}").decode("utf-8")  # set before the segment's name
    if theirs == mine and start_time(info["pid"]) != info["start"]:
        raise PeerDeadError(peer, what, f"it created its control segment, then its process (pid {info['pid']}) "
                            "exited or aborted during init; see its log for the cause")
    if theirs == mine:
        raise PeerDeadError(peer, what, f"it removed its control segment during init (its process, pid "
                            f"{info['pid']}, is closing or aborting); see its log for the cause")
    raise rdzv.RendezvousError(
        f"shared-memory control segment {info['name']!r} of {peer} not found: the two ranks do not share "
        "/dev/shm (different hosts or containers); set connector_extra_config.control_channel to 'tcp' "
        "on every rank")


# ---------------------------------------------------------------------------
# Control plane
# ---------------------------------------------------------------------------


class AFDControlPlane:
    """The reference's DP-metadata control plane (``connector.control_plane``) over host channels.

    One object per connector, built device-light at construction and kept
    across ``close()`` / ``init_afd_connector()``: :meth:`open` opens this
    rank's channels (collective, at init), :meth:`close` releases them (the
    object can be opened again). No device synchronisation anywhere.

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
        from .codec import DEFAULT_MAX_CONTROL_BYTES

        self._apply = apply_payload
        self._check_send = check_send
        self.topology = topology
        self.role = _normalise_role(role)
        self.role_rank = role_rank
        self.label = label or f"{self.role} rank {role_rank}"
        self.recv_timeout_s = recv_timeout_s
        self.max_payload_bytes = max_payload_bytes or DEFAULT_MAX_CONTROL_BYTES
        if self.role == "attention":
            self.destinations: tuple[int, ...] = tuple(topology.control_destinations(role_rank))
            self.source: int | None = None
        else:
            self.destinations = ()
            self.source = topology.control_source(role_rank)
        self.channels: dict[int, ControlChannel] = {}
        self.store: AFDStore | None = None
        # While open: (the channels to self.destinations in order, the source's channel, the store). One
        # attribute, read once per call: a close() on another thread swaps it for None in one store.
        self._links: tuple[tuple[ControlChannel, ...], ControlChannel | None, AFDStore | None] | None = None
        self._received: Any = None  # (payload, sender's label, store) recv_dp_metadata_list returned last
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
        if self._links is not None:
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
        self._links = (tuple(self.channels[f] for f in self.destinations), self.channels.get(self.source), store)

    @property
    def is_open(self) -> bool:
        """Whether the channels are open (between :meth:`open` and :meth:`close`)."""
        return self._links is not None

    @property
    def is_sender(self) -> bool:
        """Whether this rank sends control payloads (attention rank ``< min(A, F)``)."""
        return bool(self.destinations)

    def close(self) -> None:
        """Close every channel (idempotent; a sender's close tells its FFN ranks). :meth:`open` may follow.

        From any thread: a call in flight on another thread ends promptly with :class:`AFDClosedError`.
        """
        channels, self.channels = self.channels, {}
        self._links = None
        self.store = None
        for ch in channels.values():
            try:
                ch.close()
            except Exception as e:  # noqa: BLE001 - close must not raise
                logger.warning("closing control channel to %s: %s", ch.peer, e)

    def _require_open(self, op: str) -> Any:
        """The links, read once; AFDStateError when not open (never opened, or closed before this call)."""
        links = self._links
        if links is None:
            raise AFDStateError(
                f"AFD connector ({self.label}) is not initialized; call init_afd_connector() before {op}"
            )
        return links

    # -- the reference's three calls ------------------------------------------------

    def update_state_from_dp_metadata(self, payload: Any) -> None:
        """Apply ``payload`` locally (no network): validate the step, build its schedule.

        Attention ranks call it before :meth:`send_dp_metadata_list` every step;
        FFN ranks after :meth:`recv_dp_metadata_list`.

        Raises:
            ControlProtocolError: on an FFN rank, the payload :meth:`recv_dp_metadata_list` returned
                does not fit this job (e.g. a count vector of the wrong length): the sender's
                fault, named; the step-abort signal is posted first, so every rank stops at once.
            Whatever ``apply_payload`` raises for an invalid step or a wrong state.
        """
        received = self._received
        if payload is None or received is None or payload is not received[0]:
            self._apply(payload)
            return
        self._received = None
        try:
            self._apply(payload)
        except ValueError as e:
            err = ControlProtocolError(f"{_OP_RECV}: the control payload from {received[1]} "
                                       f"does not fit this job: {e}")
            if received[2] is not None:
                rdzv.post_abort(received[2], str(err))
            raise err from None

    def send_dp_metadata_list(self, payload: Any) -> None:
        """Send ``payload`` to this attention rank's control destinations (a no-op on non-senders).

        Args:
            payload: an :class:`~afd_ext.metadata.AFDControlPayload`.

        Raises:
            AFDStateError: not open (connector not initialised).
            AFDClosedError: closed meanwhile by another thread.
            AFDConfigError: not a valid control payload, or larger than the channel's limit.
            PeerDeadError: a destination FFN rank is gone.
            ControlChannelClosed: a destination FFN rank closed its channel (shm).
        """
        sends = self._require_open("send_dp_metadata_list")[0]
        if self._check_send is not None:
            self._check_send(payload)
        for ch in sends:  # an invalid payload fails the first, before anything moves
            ch.send_payload(payload)

    def recv_dp_metadata_list(self) -> Any:
        """FFN side: block until the next step's payload arrives; return it decoded.

        Returns:
            A new :class:`~afd_ext.metadata.AFDControlPayload` (the counts are CPU
            int32 tensors on access, as the reference's runners read them).

        Raises:
            AFDStateError: called on an attention rank, or not open.
            AFDClosedError: closed meanwhile by another thread.
            PeerDeadError: the source attention rank died (its heartbeat stopped).
            ControlChannelClosed: the source closed its channel (clean shutdown).
            ControlRecvTimeout: ``recv_timeout_s`` passed.
            StepAbortedError: some rank posted the step-abort signal.
            ControlProtocolError: a malformed payload or frame (names the source);
                the step-abort signal is posted first, so every rank stops at once.
        """
        if self.role != "ffn":
            raise AFDStateError(f"recv_dp_metadata_list is called on FFN ranks only; this is {self.label}")
        _, ch, store = self._require_open(_OP_RECV)
        try:  # the channel's native take decodes the payload
            p = ch.recv(self.recv_timeout_s, _OP_RECV, self.max_payload_bytes)
        except ControlProtocolError as e:
            if store is not None:  # every rank stops at once
                rdzv.post_abort(store, str(e))
            raise
        except ControlChannelClosed:
            if store is not None:  # a sender that aborted the step closes its channel: report the cause
                store.abort_signal.check(_OP_RECV)  # a lost store reads as no abort: the close stands
            raise
        self._received = (p, ch.peer, store)
        return p

