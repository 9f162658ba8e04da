"""The TCP channel (across hosts): length-prefixed frames, heartbeat frames from the sender."""

from __future__ import annotations

import select
import socket
import struct
import threading
import time

from afd_ext import rendezvous as rdzv
from afd_ext.errors import AFDPeerError, ControlChannelClosed, ControlProtocolError, PeerDeadError
from afd_ext.rendezvous import AFDStore

from .channel import (
    MAX_NATIVE_WAIT_NS,
    _ABORT_EVERY_S,
    _due_in,
    _FALLBACK_SPIN_S,
    _OP_RECV,
    _OP_SEND,
    ChannelOptions,
    ControlChannel,
    _native,
    logger,
)


# ---------------------------------------------------------------------------
# TCP
# ---------------------------------------------------------------------------

_TCP_MAGIC = 0xAFDC7C01
_TCP_HDR = struct.Struct("<IIIQ")  # magic, type, sender world rank, length
_T_HELLO, _T_DATA, _T_HEARTBEAT, _T_CLOSE = 1, 2, 3, 4


def _advertise_address(store: AFDStore) -> str:
    """The local address peers should connect to: the one routing to the rendezvous host."""
    from afd_ext import envs

    override = envs.get("AFD_CONTROL_ADDR")
    if override:
        return override
    try:
        infos = socket.getaddrinfo(store.host, store.port, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return socket.gethostbyname(socket.gethostname())
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(addr)  # no packet is sent; the kernel picks the route and source address
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class TcpControlChannel(ControlChannel):
    """Length-prefixed frames over one TCP connection (``TCP_NODELAY``), heartbeat frames from the sender."""

    kind = "tcp"

    def __init__(self, sock: socket.socket, **kw):
        super().__init__(**kw)
        self._sock = sock
        self._lock = threading.Lock()
        self._rbuf = bytearray()
        self._last_seen = time.monotonic()
        self._token = b""
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._practice: bytes | None = None  # warm_s: the last payload, decoded again while polling
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @staticmethod
    def listen(store: AFDStore) -> socket.socket:
        """Receiver: a listening socket on the advertised address, port chosen by the kernel."""
        addr = _advertise_address(store)
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
        family, stype, proto, _, sa = infos[0]
        ls = socket.socket(family, stype, proto)
        ls.bind(sa)
        ls.listen(16)
        return ls

    @classmethod
    def accept(cls, ls: socket.socket, deadline: float, *, local_rank: int, peer_rank: int, peer: str,
               options: ChannelOptions, abort_check=None, store: AFDStore | None = None,
               token: bytes | None = None) -> "TcpControlChannel":
        """Receiver: accept the sender's connection; a hello from another rank, or with a token
        other than ``token`` (a stale sender of an earlier generation), is refused and waited past."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise rdzv.RendezvousTimeoutError(
                    f"{peer} did not connect its TCP control channel in time",
                    missing=(peer_rank,), what="control channel connect",
                )
            r, _, _ = select.select([ls], [], [], min(left, 0.1))
            if store is not None:
                rdzv.raise_if_aborted(store, op=f"waiting for {peer} to connect the control channel")
            if not r:
                continue
            conn, _ = ls.accept()
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                hdr = _recv_exact(conn, _TCP_HDR.size)
                magic, typ, sender, n = _TCP_HDR.unpack(hdr)
                body = _recv_exact(conn, n) if magic == _TCP_MAGIC and typ == _T_HELLO and n < 256 else b""
            except (OSError, ConnectionError):
                conn.close()
                continue
            if magic != _TCP_MAGIC or typ != _T_HELLO or sender != peer_rank or (
                    token is not None and body != token):
                logger.warning("control channel: refused a connection (world rank %d, expected %s)",
                               sender, peer)
                conn.close()
                continue
            conn.setblocking(True)
            conn.settimeout(None)
            ch = cls(conn, is_sender=False, local_rank=local_rank, peer_rank=peer_rank, peer=peer,
                     options=options, abort_check=abort_check)
            ch._token = body
            return ch

    @classmethod
    def connect(cls, addr: tuple[str, int], deadline: float, token: bytes, *, local_rank: int,
                peer_rank: int, peer: str, options: ChannelOptions, abort_check=None) -> "TcpControlChannel":
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
                f"could not connect the TCP control channel to {peer} at {addr[0]}:{addr[1]}: {last}",
                missing=(peer_rank,), what="control channel connect",
            )
        ch = cls(sock, is_sender=True, local_rank=local_rank, peer_rank=peer_rank, peer=peer,
                 options=options, abort_check=abort_check)
        # Sends time out so a receiver that stopped reading cannot block the sender forever.
        sock.settimeout(options.heartbeat_timeout_s)
        ch._send_frame(_T_HELLO, token)
        ch._start_heartbeat()
        return ch

    def _send_frame(self, typ: int, data: bytes | memoryview = b"") -> None:
        frame = _TCP_HDR.pack(_TCP_MAGIC, typ, self.local_rank, len(data))
        with self._lock:
            if len(data) <= 65536:
                self._sock.sendall(frame + bytes(data))
            else:
                self._sock.sendall(frame)
                self._sock.sendall(data)

    def _beat(self) -> bool:
        try:
            self._send_frame(_T_HEARTBEAT)
        except OSError:
            return False
        return True

    def send(self, data: bytes) -> None:
        self._require(True, "send")
        self._check_len(len(data))
        try:
            self._send_frame(_T_DATA, data)
        except socket.timeout:
            raise PeerDeadError(
                self.peer, _OP_SEND,
                f"it read nothing for {self.options.heartbeat_timeout_s:g} s (TCP send buffer full)",
            ) from None
        except OSError as e:
            raise PeerDeadError(self.peer, _OP_SEND, f"connection lost ({e})") from None

    def _fill(self, need: int, deadline: float | None, op: str) -> None:
        """Read from the socket until ``need`` bytes are buffered, watching liveness."""
        sock = self._sock
        poller = self._poller
        hb = self.options.heartbeat_timeout_s
        now = time.monotonic()
        next_abort = now + _due_in(_ABORT_EVERY_S)
        native = _native()
        # While the engine is active keep polling (see the module doc), then block in poll().
        poll_until = self._last_msg + self.options.idle_s
        if native is None:
            poll_until = min(poll_until, now + _FALLBACK_SPIN_S)
        spin_fd = native.spin_fd if native is not None else None
        warm = self.options.warm_s if self._practice is not None else 0.0
        next_warm = now + warm if warm else float("inf")
        while len(self._rbuf) < need:
            if now < poll_until:
                if spin_fd is not None:
                    end = min(poll_until, next_abort, next_warm)
                    if deadline is not None:
                        end = min(end, deadline)
                    if spin_fd(sock.fileno(), min(int((end - now) * 1e9), MAX_NATIVE_WAIT_NS)) == 0 and \
                            time.monotonic() >= next_warm:
                        self._rehearse()
                        next_warm = time.monotonic() + warm
                wait_ms = 0
            else:
                wait_ms = int(1000 * min(_ABORT_EVERY_S, max(0.0, self._last_seen + hb - now) + 0.001))
                if deadline is not None:
                    wait_ms = min(wait_ms, max(0, int(1000 * (deadline - now)) + 1))
            events = poller.poll(wait_ms)
            if events:
                try:
                    chunk = sock.recv(max(65536, need - len(self._rbuf)))
                except (ConnectionResetError, OSError) as e:
                    raise PeerDeadError(self.peer, op, f"connection lost ({e})") from None
                if not chunk:
                    raise PeerDeadError(self.peer, op, "its connection closed without a goodbye (process exited)")
                self._rbuf += chunk
                now = self._last_seen = time.monotonic()
                continue
            now = time.monotonic()
            if now - self._last_seen > hb:
                raise PeerDeadError(
                    self.peer, op,
                    f"no heartbeat for {now - self._last_seen:.1f} s (heartbeat_timeout_s={hb:g}); "
                    "the process or its host is hung or unreachable",
                )
            next_abort = self._abort_or_timeout(op, now, next_abort, deadline, None)

    def _rehearse(self) -> bool:
        """warm_s: the receive path on nothing new (a peek at the socket, the payload decoded and built
        again from the last one), so that a payload after a long gap finds it in cache. Returns whether
        the copy decoded."""
        from afd_ext.metadata import decode_control_binary

        if self._practice is None:
            return False
        try:
            self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # nothing to read (the usual case), or the peer is gone: recv() reports that
            pass
        try:
            decode_control_binary(self._practice)  # type: ignore[arg-type]
        except ValueError:  # not a binary control payload (raw channel use): nothing to rehearse
            self._practice = None
            return False
        return True

    def recv(self, timeout_s: float | None = None, op: str = _OP_RECV) -> bytes:
        self._require(False, "recv")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._fill(_TCP_HDR.size, deadline, op)
            magic, typ, sender, n = _TCP_HDR.unpack_from(self._rbuf, 0)
            if magic != _TCP_MAGIC:
                raise ControlProtocolError(f"{op}: corrupt control frame from {self.peer} (bad magic {magic:#x})")
            self._check_header(op, sender, n)
            end = _TCP_HDR.size + n
            self._fill(end, None, op)  # the rest of a started frame is already on its way
            body = bytes(self._rbuf[_TCP_HDR.size:end])
            del self._rbuf[:end]
            if typ == _T_DATA:
                self._last_msg = time.monotonic()
                if self.options.warm_s and self._practice is None:
                    self._practice = body
                return body
            if typ == _T_CLOSE:
                raise ControlChannelClosed(f"{op}: {self.peer} closed the control channel")
            if typ != _T_HEARTBEAT:
                raise ControlProtocolError(f"{op}: unexpected control frame type {typ} from {self.peer}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._hb_stop.set()
        if self.is_sender:
            try:
                self._send_frame(_T_CLOSE)
            except OSError:
                pass
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        try:
            self._sock.close()
        except OSError:
            pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AFDPeerError("connection closed")
        buf += chunk
    return bytes(buf)
