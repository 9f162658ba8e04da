"""The TCP channel (across hosts): length-prefixed frames, heartbeat frames from the sender."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Iterator

from afd_ext import rendezvous as rdzv
from afd_ext.errors import AFDPeerError, AFDStateError, ControlChannelClosed, ControlProtocolError, PeerDeadError
from afd_ext.rendezvous import AFDStore

from .channel import (
    MAX_NATIVE_WAIT_NS,
    _ABORT_EVERY_S,
    _due_in,
    _ns,
    _FALLBACK_SPIN_S,
    _OP_RECV,
    _OP_SEND,
    ChannelOptions,
    ControlChannel,
    WarmState,
    _native,
    logger,
)


# ---------------------------------------------------------------------------
# TCP
# ---------------------------------------------------------------------------

_TCP_MAGIC = 0xAFDC7C01
_TCP_HDR = struct.Struct("<IIIQ")  # magic, type, sender world rank, length
_T_HELLO, _T_DATA, _T_HEARTBEAT, _T_CLOSE = 1, 2, 3, 4
_READ_BYTES = 65536  # one read of the receive path
_QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux


class TcpState(ctypes.Structure):
    """One end of one TCP channel as the native code sees it (``struct afd_ctrl_tcp``); fd -1: closed."""

    _fields_ = [
        ("fd", ctypes.c_int32),
        ("local_rank", ctypes.c_uint32),
        ("expect_sender", ctypes.c_uint32),  # receiver: the sender's world rank
        ("busy", ctypes.c_uint32),  # native calls in flight on this end (close() waits for 0)
        ("max_msg", ctypes.c_uint64),  # the largest message body handled natively
        ("buf", ctypes.c_void_p),  # receiver: the read buffer
        ("cap", ctypes.c_uint64),
        ("t_ns", ctypes.c_int64),  # receiver: CLOCK_MONOTONIC ns when the poll saw the socket readable
        ("warm", WarmState),  # receiver: the rehearsal
        ("proxy", ctypes.c_void_p),  # sender: its proxy while one runs (set and cleared in C)
        ("warm_tx", ctypes.c_int32),  # receiver: the rehearsal's private loopback pair (-1: none)
        ("warm_rx", ctypes.c_int32),
        ("warm_rounds", ctypes.c_uint64),  # receiver: rehearsal rounds over that pair
        ("send_lock", ctypes.c_uint32),  # sender: 1 while a frame goes out (every frame takes it, in C)
        ("send_err", ctypes.c_int32),  # sender: errno of the last native send that failed part-way
        ("send_timeout_ns", ctypes.c_int64),  # sender: bound on a send's wait for the lock or buffer space
        ("send_rests", ctypes.c_uint64),  # sender: frames taken in part whose rest the native send sent
        ("pending", ctypes.c_uint32),  # receiver: 1 while _rbuf holds bytes of a started frame
        ("pad_", ctypes.c_uint32),
        ("msg_ns", ctypes.c_int64),  # receiver: when the poll saw the last payload built natively
    ]


def _loopback_pair() -> tuple[socket.socket, socket.socket] | None:
    """A connected, non-blocking TCP pair on 127.0.0.1 (``TCP_NODELAY``) for the native rounds that
    keep the kernel's TCP path warm on a CPU (docs/configuration.md); None when loopback fails."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as ls:
            ls.bind(("127.0.0.1", 0))
            ls.listen(1)
            a = socket.create_connection(ls.getsockname(), timeout=5.0)
            b, _ = ls.accept()
    except OSError as e:
        logger.debug("afd_ext control plane: no loopback pair for the tcp rounds (%s)", e)
        return None
    for sk in (a, b):
        sk.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sk.setblocking(False)
    return a, b


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
        self._lock = threading.Lock()  # the send lock without the compiled core (else the state's, in C)
        self._broken = False  # a frame was left part-sent: nothing more goes out (_write_frame)
        self._rbuf = bytearray()
        self._last_seen = time.monotonic()
        self._token = b""
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The native path's view of this end (the anchor pins the read buffer).
        self._native = _native()
        self._read = bytearray(_READ_BYTES)
        self._read_anchor: Any = (ctypes.c_char * _READ_BYTES).from_buffer(self._read)
        self._state = TcpState(fd=sock.fileno(), local_rank=self.local_rank, expect_sender=self.peer_rank,
                               max_msg=self.options.max_message_bytes, buf=ctypes.addressof(self._read_anchor),
                               cap=_READ_BYTES, warm_tx=-1, warm_rx=-1,
                               send_timeout_ns=_ns(self.options.heartbeat_timeout_s))
        self._state.warm.arm(self.is_sender, self.options)
        self._state_addr = ctypes.addressof(self._state)
        # A private loopback pair: a waiting receiver's rehearsal rounds, or the sender's proxy's.
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._keeper: Any = None  # a sender's proxy (ChannelOptions.keep_s), holding this end's state
        if self._native is not None and (self._state.warm.warm_ns > 0 if not self.is_sender
                                         else self.options.proxy_on()):
            self._pair = _loopback_pair()
        if self._pair is not None and not self.is_sender:
            self._state.warm_tx, self._state.warm_rx = (sk.fileno() for sk in self._pair)
        elif self._pair is not None:
            try:
                self._keeper = self._native.tcp_proxy_start(
                    self._state_addr, (self._state, self._read_anchor), _ns(self.options.keep_s),
                    _ns(self.options.idle_s), *(sk.fileno() for sk in self._pair), self.options.keep_cpus)
            except BaseException:
                for sk in self._pair:
                    sk.close()
                raise

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

    def _take_lock(self) -> bool:
        """Take the end's send lock, which every frame goes out under (the native sends take it in
        C), so that a frame's bytes are never interleaved with another's; False when it is not had
        within ``heartbeat_timeout_s`` (another send is blocked on a full buffer)."""
        if self._native is None:
            return self._lock.acquire(timeout=self.options.heartbeat_timeout_s)
        return bool(self._native.tcp_lock(self._state_addr, self._state.send_timeout_ns))

    def _drop_lock(self) -> None:
        if self._native is None:
            self._lock.release()
        else:
            self._native.tcp_unlock(self._state_addr)

    def _send_frame(self, typ: int, data: bytes | memoryview = b"", *, skip_if_busy: bool = False) -> bool:
        """Send one frame under the send lock. Returns False when ``skip_if_busy`` and the lock was
        not had in time (nothing sent); raises PeerDeadError when not (or the stream is broken)."""
        if not self._take_lock():
            if skip_if_busy:
                return False
            raise self._blocked()
        try:
            self._write_frame(typ, data)
        finally:
            self._drop_lock()
        return True

    def _write_frame(self, typ: int, data: bytes | memoryview = b"") -> None:
        """The frame's bytes on the socket (the send lock held). A failure part-way leaves the stream
        unframed: the end is marked broken and sends nothing more (PeerDeadError from then on)."""
        if self._broken:
            raise PeerDeadError(self.peer, _OP_SEND, "an earlier frame was left part-sent (the stream is broken)")
        frame = _TCP_HDR.pack(_TCP_MAGIC, typ, self.local_rank, len(data))
        try:
            if len(data) <= 65536:
                self._sock.sendall(frame + bytes(data))
            else:
                self._sock.sendall(frame)
                self._sock.sendall(data)
        except OSError:
            self._break()
            raise

    def _break(self) -> None:
        """Mark the stream broken (a frame left part-sent): the native sends decline from now on."""
        self._broken = True
        self._state.fd = -1  # the sending end's view only; close() still closes the socket

    def _beat(self) -> bool:
        try:
            self._send_frame(_T_HEARTBEAT, skip_if_busy=True)  # a long send holds the lock: skip this beat
        except OSError:
            return False
        return True

    def send(self, data: bytes) -> None:
        self._require(True, "send")
        self._check_len(len(data))
        with self._send_errors():
            self._send_frame(_T_DATA, data)

    @contextlib.contextmanager
    def _send_errors(self) -> Iterator[None]:
        """A blocked or broken send is the receiver's loss, named (PeerDeadError)."""
        try:
            yield
        except socket.timeout:
            raise self._blocked() from None
        except OSError as e:
            raise PeerDeadError(self.peer, _OP_SEND, f"connection lost ({e})") from None

    def _blocked(self) -> PeerDeadError:
        return PeerDeadError(self.peer, _OP_SEND,
                             f"it read nothing for {self.options.heartbeat_timeout_s:g} s (TCP send buffer full)")

    def send_front(self, check: Any, fallback: Any) -> Any:
        if self._native is None or not self.is_sender:
            return None
        # One native object per front (it holds this channel: the state lives as long).
        return self._native.tcp_send_front(self._state_addr, check, fallback, self)

    def send_payload(self, payload: Any) -> None:
        r = self._native.tcp_send_payload(self._state_addr, payload) if self._native is not None else -2
        if r == 0:
            return
        if r != -2:
            self._send_failed(r)
        super().send_payload(payload)

    def _send_failed(self, code: int) -> None:
        """A native send that failed (``ctrl_tcp_send_payload``'s code -3/-4/-5), named; always raises."""
        self._require(True, _OP_SEND)  # closed meanwhile: that, not the peer
        if code in (-4, -5):
            self._break()  # the socket took part of the frame
        if code == -3:
            raise AFDStateError(f"{_OP_SEND}: the send proxy of the control channel to {self.peer} took the "
                                "frame and did not send it within 5 s (its thread stalled; the frame may still "
                                "arrive later, and this channel's sends no longer use the proxy)")
        if code == -4:
            raise self._blocked()
        raise PeerDeadError(self.peer, _OP_SEND, f"connection lost ({os.strerror(self._state.send_err)})")

    def take_front(self, max_stages: int, max_ranks: int, prepare: Any, fallback: Any) -> Any:
        if self._native is None or self.is_sender:
            return None
        # One native object per front (it holds this channel: the state and its buffer live as long).
        return self._native.tcp_take_front(self._state_addr, prepare, fallback, self, max_stages, max_ranks)

    def recv_payload(self, timeout_s: float | None, op: str, max_stages: int, max_ranks: int,
                     max_bytes: int, started: float | None = None) -> Any:
        self._set_limits(max_stages, max_ranks, max_bytes)
        return self._recv(timeout_s, op, started)

    def _fill(self, need: int, deadline: float | None, op: str) -> Any:
        """Read from the socket until ``need`` bytes are buffered, watching liveness. Returns None,
        or the payload the native read built (a whole data frame read alone into an empty buffer,
        with ``self._limits`` >= 0)."""
        poller = self._poller
        hb = self.options.heartbeat_timeout_s
        now = time.monotonic()
        next_abort = now + _due_in(_ABORT_EVERY_S)
        native = self._native
        # While the engine is active keep polling (see the module doc), then block in poll().
        poll_until = self._poll_until()
        if native is None:
            poll_until = min(poll_until, now + _FALLBACK_SPIN_S)
        while len(self._rbuf) < need:
            chunk: Any = -1
            if now < poll_until:
                if native is not None:  # wait natively (GIL released) and read
                    end = min(poll_until, next_abort)  # the native take rehearses meanwhile
                    if deadline is not None:
                        end = min(end, deadline)
                    chunk = self._read_native(min(int((end - now) * 1e9), MAX_NATIVE_WAIT_NS), op)
                wait_ms = 0
            else:
                wait_ms = int(1000 * min(_ABORT_EVERY_S, max(0.0, self._seen() + hb - now) + 0.001))
                if deadline is not None:
                    wait_ms = min(wait_ms, max(0, int(1000 * (deadline - now)) + 1))
            if chunk == -1 and poller.poll(wait_ms):
                chunk = self._read_native(0, op) if native is not None else self._read_python(need, op)
            if type(chunk) is bytes:
                if not chunk:
                    raise PeerDeadError(self.peer, op, "its connection closed without a goodbye (process exited)")
                self._stash(chunk)
                now = self._last_seen
                continue
            if type(chunk) is not int:  # built natively
                self._last_seen = self._last_msg = time.monotonic()
                return chunk
            now = time.monotonic()
            seen = self._seen()
            if now - seen > hb:
                raise PeerDeadError(
                    self.peer, op,
                    f"no heartbeat for {now - seen:.1f} s (heartbeat_timeout_s={hb:g}); "
                    "the process or its host is hung or unreachable",
                )
            next_abort = self._abort_or_timeout(op, now, next_abort, deadline, None)
        return None

    def _read_native(self, max_ns: int, op: str) -> Any:
        """Wait up to ``max_ns`` (GIL released) and read once: -1 (nothing), bytes, or a payload built
        from a whole data frame read alone into an empty buffer (``self._limits`` >= 0; the native
        take reads raw bytes while ``_rbuf`` holds some: ``TcpState.pending``)."""
        try:
            r = self._native.tcp_take(self._state_addr, max_ns, *self._limits)
        except OSError as e:
            self._read_failed(e.errno or 0, op)
        if r == -2:  # closed by another thread meanwhile: named, not a spin until the heartbeat timeout
            self._require(False, op)
            return -1
        return r

    def _read_failed(self, err: int, op: str = _OP_RECV) -> None:
        """A native poll or read that failed with ``err`` (errno), named; always raises."""
        self._require(False, op)  # closed here by another thread: not the peer's fault
        raise PeerDeadError(self.peer, op, f"connection lost ({os.strerror(err)})")

    def _stash(self, data: bytes) -> None:
        """Keep bytes read off the stream for the framing (a native read that was not one payload)."""
        if data:
            self._rbuf += data
            self._state.pending = 1
            self._last_seen = time.monotonic()

    def _seen(self) -> float:
        """When the sender was last heard from (monotonic s): a native read of heartbeats stamps t_ns."""
        return max(self._last_seen, self._state.t_ns * 1e-9)

    def _poll_until(self) -> float:
        # The last payload's time: a native take stamps it (CLOCK_MONOTONIC, as time.monotonic()).
        return max(self._last_msg, self._state.msg_ns * 1e-9) + self.options.idle_s

    def _read_python(self, need: int, op: str) -> bytes:
        try:
            return self._sock.recv(max(_READ_BYTES, need - len(self._rbuf)))
        except (ConnectionResetError, OSError) as e:
            self._require(False, op)  # closed here by another thread: not the peer's fault
            raise PeerDeadError(self.peer, op, f"connection lost ({e})") from None

    def recv(self, timeout_s: float | None = None, op: str = _OP_RECV) -> bytes:
        self._set_limits(-1, 0, self.options.max_message_bytes)
        return self._recv(timeout_s, op)

    def _recv(self, timeout_s: float | None, op: str, started: float | None = None) -> Any:
        self._require(False, op)
        deadline = None if timeout_s is None else (started or time.monotonic()) + timeout_s
        if _QUICKACK is not None and not self._rbuf and self._native is None:
            # Delayed ACKs before each wait, as the native take does (csrc/cpu/control_poll.cpp tcp_take).
            try:
                self._sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 0)
            except OSError:
                pass
        while True:
            built = self._fill(_TCP_HDR.size, deadline, op)
            if built is not None:
                return built
            magic, typ, sender, n = _TCP_HDR.unpack_from(self._rbuf, 0)
            if magic != _TCP_MAGIC:
                raise ControlProtocolError(f"{op}: corrupt control frame from {self.peer} (bad magic {magic:#x})")
            self._check_header(op, sender, n)
            end = _TCP_HDR.size + n
            self._fill(end, None, op)  # the rest of a started frame is already on its way
            body = bytes(self._rbuf[_TCP_HDR.size:end])
            del self._rbuf[:end]
            self._state.pending = 1 if self._rbuf else 0
            if typ == _T_DATA:
                self._last_msg = time.monotonic()
                return body
            if typ == _T_CLOSE:
                raise ControlChannelClosed(f"{op}: {self.peer} closed the control channel")
            if typ != _T_HEARTBEAT:
                raise ControlProtocolError(f"{op}: unexpected control frame type {typ} from {self.peer}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._keeper is not None:
            self._native.keeper_stop(self._keeper)  # joined: it sends on this end's socket
            self._keeper = None
        # A sender's frame in flight (a native send finishing a frame the socket took in part) ends
        # before the goodbye: take the send lock first (bounded; without it, no goodbye).
        held = self.is_sender and self._take_lock()
        try:
            # The native calls decline from now on; one in flight on another thread ends first.
            release = self._quiesce_native(lambda: setattr(self._state, "fd", -1))
            self._hb_stop.set()
            if held:
                try:
                    self._write_frame(_T_CLOSE)
                except OSError:
                    pass
        finally:
            if held:
                self._drop_lock()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        if not release:  # a native read still in flight holds the descriptors' numbers
            return
        for sk in (self._sock, *(self._pair or ())):
            try:
                sk.close()
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
