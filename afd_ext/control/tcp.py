"""The TCP channel (across hosts): length-prefixed frames, heartbeat frames from the sender.

Frames are ``magic u32 | type u32 | sender world rank u32 | length u64 | bytes``, built and split
natively (``_C.ctrl_tcp_send``; ``_C.ctrl_tcp_take``, which waits with the GIL released and decodes
a payload); the checks are here.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from typing import Any

from afd_ext import rendezvous as rdzv
from afd_ext.errors import AFDError, ControlChannelClosed, ControlProtocolError, PeerDeadError
from .codec import DEFAULT_MAX_RANKS, DEFAULT_MAX_STAGES, _native

from .channel import _OP_SEND, _SLICE_S, ControlChannel, logger

_T_HELLO, _T_DATA, _T_HEARTBEAT, _T_CLOSE = 1, 2, 3, 4


def _advertise_address(store: Any) -> str:
    """The local address peers should connect to: the one routing to the rendezvous host."""
    from afd_ext import envs

    override = envs.get("AFD_CONTROL_ADDR")
    if override:
        return override
    try:
        family, _, _, _, addr = socket.getaddrinfo(store.host, store.port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # no packet is sent; the kernel picks the route and source address
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class TcpControlChannel(ControlChannel):
    """Length-prefixed frames over one TCP connection (``TCP_NODELAY``), heartbeat frames from the sender."""

    kind = "tcp"

    def __init__(self, sock: socket.socket, rbuf: bytearray | None = None, **kw: Any):
        super().__init__(**kw)
        self._sock = sock
        self._fd = sock.fileno()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()  # every frame goes out whole under it (the heartbeat thread's too)
        self._broken = False  # a frame was left part-sent: nothing more goes out
        self._rbuf = rbuf if rbuf is not None else bytearray()  # received bytes not yet taken
        self._last_seen = time.monotonic()
        self._ended: str | None = None  # the peer's end: "close" (its goodbye frame) or "eof"

    @staticmethod
    def listen(store: Any) -> socket.socket:
        """Receiver: a listening socket on the advertised address, port chosen by the kernel."""
        family, stype, proto, _, sa = socket.getaddrinfo(_advertise_address(store), 0, type=socket.SOCK_STREAM)[0]
        ls = socket.socket(family, stype, proto)
        ls.bind(sa)
        ls.listen(16)
        return ls

    @classmethod
    def accept(cls, ls: socket.socket, deadline: float, *, store: Any = None, token: bytes | None = None,
               **kw: Any) -> "TcpControlChannel":
        """Receiver: accept the sender's connection; a hello from another rank, or with a token
        other than ``token`` (a stale sender of an earlier generation), is refused and waited past."""
        peer, peer_rank = kw["peer"], kw["peer_rank"]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise rdzv.RendezvousTimeoutError(f"{peer} did not connect its TCP control channel in time",
                                                  missing=(peer_rank,), what="control channel connect")
            r, _, _ = select.select([ls], [], [], min(left, 0.1))
            if store is not None:
                rdzv.raise_if_aborted(store, op=f"waiting for {peer} to connect the control channel")
            if not r:
                continue
            conn, _ = ls.accept()
            rbuf = bytearray()  # what follows the hello stays for the channel
            try:
                got = _native().ctrl_tcp_take(conn.fileno(), rbuf, 255, 0, int(deadline * 1e9), -1, 0)
            except OSError:
                got = None
            if type(got) is not tuple or got[0] != _T_HELLO or got[1] != peer_rank or got[3] is None or (
                    token is not None and got[3] != token):
                logger.warning("control channel: refused a connection (%r, expected %s)", got, peer)
                conn.close()
                continue
            return cls(conn, rbuf, is_sender=False, **kw)

    @classmethod
    def connect(cls, addr: tuple[str, int], deadline: float, token: bytes, **kw: Any) -> "TcpControlChannel":
        """Sender: connect to the receiver, introduce itself, start the heartbeat."""
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                sock = socket.create_connection(addr, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                break
            except OSError as e:
                last = e
                time.sleep(0.05)
        else:
            raise rdzv.RendezvousTimeoutError(
                f"could not connect the TCP control channel to {kw['peer']} at {addr[0]}:{addr[1]}: {last}",
                missing=(kw["peer_rank"],), what="control channel connect")
        ch = cls(sock, is_sender=True, **kw)
        # Sends time out so a receiver that stopped reading cannot block the sender forever.
        sock.settimeout(ch.options.heartbeat_timeout_s)
        ch._frame(_T_HELLO, token)
        ch._start_heartbeat()
        return ch

    def _frame(self, typ: int, data: Any = b"", lock_s: float | None = None) -> Any:
        """Send one frame (``data``: bytes, or a payload encoded natively) under the send lock, taken within
        ``lock_s`` seconds (None: ``heartbeat_timeout_s``, then PeerDeadError).

        Returns None, nothing sent, for a payload the native encoder does not take as it is, or when
        ``lock_s`` passed with the lock busy; else True. A sender first looks for the receiver's end.
        """
        if not self._lock.acquire(timeout=self.options.heartbeat_timeout_s if lock_s is None else lock_s):
            if lock_s is not None:
                return None
            raise PeerDeadError(self.peer, _OP_SEND, "another send stayed blocked for heartbeat_timeout_s")
        try:
            if self.is_sender and self._ended is None:
                try:  # one read that does not wait: a receiver sends nothing but its goodbye
                    got = self._C.ctrl_tcp_take(self._fd, self._rbuf, self._max_bytes, 0, 0, -1, 0)
                except OSError:
                    got = 0  # reset: gone without a goodbye
                if got is not None:
                    self._ended = "close" if type(got) is tuple and got[:2] == (_T_CLOSE, self.peer_rank) else "eof"
            if self._ended is not None:
                self._check_peer(_OP_SEND)
            if self._broken:
                raise PeerDeadError(self.peer, _OP_SEND, "an earlier frame was left part-sent (the stream is broken)")
            try:
                rest = self._C.ctrl_tcp_send(self._fd, typ, self.local_rank, data, self._max_bytes)
                if type(rest) is bytes:
                    self._sock.sendall(rest)  # the send buffer is full: wait, at most the socket's timeout
                    rest = True
            except OSError as e:
                self._broken = True
                if typ == _T_DATA:
                    self._require(True, _OP_SEND)  # this end closed by another thread: not the peer's fault
                raise PeerDeadError(self.peer, _OP_SEND, f"it read nothing for {self.options.heartbeat_timeout_s:g} s "
                                    "(TCP send buffer full)" if isinstance(e, socket.timeout)
                                    else f"connection lost ({e})") from None
        finally:
            self._lock.release()
        return rest

    def _send_fast(self, payload: Any) -> bool:
        return self._frame(_T_DATA, payload) is not None  # None: a payload to convert

    def _send(self, data: bytes) -> None:
        self._frame(_T_DATA, data)

    def _beat(self) -> bool:
        try:
            self._frame(_T_HEARTBEAT, lock_s=0)  # a long send holds the lock: skip this beat
        except AFDError:  # the receiver closed or went
            return False
        return True

    def _take(self, op: str, spin_until_ns: int, end_ns: int, limit: int) -> Any:
        while self._ended is None:
            try:  # the next whole frame, split (and a payload decoded) natively; the bytes after it stay in _rbuf
                got = self._C.ctrl_tcp_take(self._fd, self._rbuf, self._max_bytes, spin_until_ns, end_ns,
                                             DEFAULT_MAX_STAGES if limit else -1, DEFAULT_MAX_RANKS)
            except OSError as e:
                self._require(False, op)  # closed here by another thread: not the peer's fault
                raise PeerDeadError(self.peer, op, f"connection lost ({e})") from None
            if type(got) is tuple and type(got[3]) is tuple and got[0] == _T_DATA and got[1] == self.peer_rank \
                    and got[2] <= limit:
                return got[3]  # the per-step case: a payload, decoded
            if got is None:
                return None
            self._last_seen = time.monotonic()
            if type(got) is str:
                raise ControlProtocolError(f"{op}: corrupt control frame from {self.peer} ({got})")
            if got == 0:
                self._ended = "eof"
                return None
            typ, sender, n, body = got
            self._check_header(op, sender, n)
            if typ == _T_DATA:
                return self._decoded(op, body, n, limit)
            if typ == _T_CLOSE:
                self._ended = "close"
            elif typ != _T_HEARTBEAT:
                raise ControlProtocolError(f"{op}: unexpected control frame type {typ} from {self.peer}")
        return None

    def _check_peer(self, op: str) -> None:
        if self._ended == "close":
            raise ControlChannelClosed(f"{op}: {self.peer} closed the control channel", op=op, peer=self.peer)
        if self._ended == "eof":
            raise PeerDeadError(self.peer, op, "its connection closed without a goodbye (process exited)")
        self._silent(op, max(self._last_seen, self._last_msg))  # a payload is a sign of life too

    def _shutdown(self) -> None:
        # Bounded: the goodbye (either end's) waits at most _SLICE_S for the lock and for socket space; a
        # send blocked on a full socket keeps the lock, and the shutdown below ends it.
        with contextlib.suppress(AFDError, OSError):
            self._sock.settimeout(_SLICE_S)
            self._frame(_T_CLOSE, lock_s=_SLICE_S)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # ends a native wait on this socket at once

    def _release(self) -> None:
        self._sock.close()
