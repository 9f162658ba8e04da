"""The TCP channel (across hosts): length-prefixed frames, heartbeat frames from the sender.

Frames are ``magic u32 | type u32 | sender world rank u32 | length u64 | bytes``. The receiver
waits, reads and splits frames natively (``_C.ctrl_tcp_take``, GIL released); the checks are here.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from typing import Any

from afd_ext import rendezvous as rdzv
from afd_ext.errors import AFDPeerError, ControlChannelClosed, ControlProtocolError, PeerDeadError

from .channel import _OP_SEND, ControlChannel, logger

_TCP_MAGIC = 0xAFDC7C01
_TCP_HDR = struct.Struct("<IIIQ")  # magic, type, sender world rank, length
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


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AFDPeerError("connection closed")
        buf += chunk
    return buf


class TcpControlChannel(ControlChannel):
    """Length-prefixed frames over one TCP connection (``TCP_NODELAY``), heartbeat frames from the sender."""

    kind = "tcp"

    def __init__(self, sock: socket.socket, **kw: Any):
        super().__init__(**kw)
        self._sock = sock
        self._fd = sock.fileno()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()  # every frame goes out whole under it (the heartbeat thread's too)
        self._broken = False  # a frame was left part-sent: nothing more goes out
        self._rbuf = bytearray()
        self._last_seen = time.monotonic()
        self._ended: str | None = None  # receiver: "close" (a goodbye frame) or "eof"

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
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                magic, typ, sender, n = _TCP_HDR.unpack(_recv_exact(conn, _TCP_HDR.size))
                body = _recv_exact(conn, n) if magic == _TCP_MAGIC and typ == _T_HELLO and n < 256 else b""
            except OSError:
                conn.close()
                continue
            if magic != _TCP_MAGIC or typ != _T_HELLO or sender != peer_rank or (token is not None and body != token):
                logger.warning("control channel: refused a connection (world rank %d, expected %s)", sender, peer)
                conn.close()
                continue
            conn.settimeout(None)
            return cls(conn, is_sender=False, **kw)

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

    def _frame(self, typ: int, data: bytes = b"", wait: bool = True) -> bool:
        """Send one frame under the send lock; False when not ``wait`` and the lock is busy."""
        if not self._lock.acquire(timeout=self.options.heartbeat_timeout_s if wait else 0):
            if not wait:
                return False
            raise PeerDeadError(self.peer, _OP_SEND, "another send stayed blocked for heartbeat_timeout_s")
        try:
            if self._broken:
                raise PeerDeadError(self.peer, _OP_SEND, "an earlier frame was left part-sent (the stream is broken)")
            frame = _TCP_HDR.pack(_TCP_MAGIC, typ, self.local_rank, len(data)) + data
            try:
                try:  # a socket with a timeout polls before each send: one write first, no poll
                    n = os.write(self._fd, frame)
                except BlockingIOError:
                    n = 0
                if n < len(frame):
                    self._sock.sendall(frame[n:])  # the send buffer is full: wait, at most heartbeat_timeout_s
            except socket.timeout:
                self._broken = True
                raise PeerDeadError(self.peer, _OP_SEND, f"it read nothing for {self.options.heartbeat_timeout_s:g} s "
                                    "(TCP send buffer full)") from None
            except OSError as e:
                self._broken = True
                raise PeerDeadError(self.peer, _OP_SEND, f"connection lost ({e})") from None
        finally:
            self._lock.release()
        return True

    def _send(self, data: bytes) -> None:
        self._frame(_T_DATA, data)

    def _beat(self) -> bool:
        try:
            self._frame(_T_HEARTBEAT, wait=False)  # a long send holds the lock: skip this beat
        except PeerDeadError:
            return False
        return True

    def _take(self, op: str, spin_until_ns: int, end_ns: int) -> bytes | None:
        while self._ended is None:
            try:  # the next whole frame, parsed natively; the bytes after it stay in _rbuf
                got = self._C.ctrl_tcp_take(self._fd, self._rbuf, _TCP_MAGIC, self._max_bytes,
                                             spin_until_ns, end_ns)
            except OSError as e:
                self._require(False, op)  # closed here by another thread: not the peer's fault
                raise PeerDeadError(self.peer, op, f"connection lost ({e})") from None
            if got is None:
                return None
            self._last_seen = time.monotonic()
            if got == 0:
                self._ended = "eof"
                return None
            magic, typ, sender, n, body = got
            if magic != _TCP_MAGIC:
                raise ControlProtocolError(f"{op}: corrupt control frame from {self.peer} (bad magic {magic:#x})")
            if sender != self.peer_rank or body is None:
                self._check_header(op, sender, n)
            if typ == _T_DATA:
                return body
            if typ == _T_CLOSE:
                self._ended = "close"
            elif typ != _T_HEARTBEAT:
                raise ControlProtocolError(f"{op}: unexpected control frame type {typ} from {self.peer}")
        return None

    def _check_peer(self, op: str) -> None:
        if self._ended == "close":
            raise ControlChannelClosed(f"{op}: {self.peer} closed the control channel")
        if self._ended == "eof":
            raise PeerDeadError(self.peer, op, "its connection closed without a goodbye (process exited)")
        self._silent(op, self._last_seen)

    def _shutdown(self) -> None:
        if self.is_sender:
            try:
                self._frame(_T_CLOSE)
            except PeerDeadError:
                pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # ends a native wait on this socket at once
        except OSError:
            pass

    def _release(self) -> None:
        self._sock.close()
