"""The control plane's C API glue (csrc/control_bindings.cpp) under the faults a review found: a C++
exception (a failed allocation) must reach Python as MemoryError, not abort the process, and must release
the buffers the call holds; a collection run by the decode's allocations must not leave the TCP receive
buffer's frame split working on a stale pointer."""

from __future__ import annotations

import gc
import os
import socket
import struct
import subprocess
import sys
import textwrap

import pytest

from afd_ext import _C
from afd_ext.control.codec import encode_control_binary
from afd_ext.metadata import AFDControlPayload

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_failed_native_allocation_is_a_memory_error_and_releases_the_buffers():
    # Address space capped just above what the process maps: the 8 GiB frame copy of ctrl_tcp_send and
    # the 1 GiB slot scratch of ctrl_shm_take fail in C++ (std::bad_alloc). Both mappings are sparse files.
    script = textwrap.dedent("""
        import mmap, resource, socket, struct, tempfile
        import torch
        from afd_ext import _C

        def vm_bytes():
            for line in open("/proc/self/status"):
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024

        f = tempfile.TemporaryFile()
        f.truncate(1 << 33)
        big = mmap.mmap(f.fileno(), 0)
        slot = 1 << 30
        g = tempfile.TemporaryFile()
        g.truncate(_C.CTRL_HEADER_BYTES + (_C.CTRL_SLOT_HEADER + slot + 63) // 64 * 64)
        ring = mmap.mmap(g.fileno(), 0)
        struct.pack_into("<QQ", ring, 8, 1 << 32, slot)  # one slot of 1 GiB
        a, b = socket.socketpair()
        cap = vm_bytes() + (256 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        out = []
        for call in (lambda: _C.ctrl_tcp_send(a.fileno(), 1, 0, big, 1 << 62),
                     lambda: _C.ctrl_shm_take(ring, 0, 0, -1, 0)):
            try:
                out.append(repr(call()))
            except MemoryError:
                out.append("MemoryError")
        big.close()  # BufferError if a call left its buffer exported
        ring.close()
        print(out)
    """)
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, f"exit {r.returncode} (-6: a C++ exception aborted the process)\n{r.stderr[-2000:]}"
    assert r.stdout.strip() == "['MemoryError', 'MemoryError']", r.stdout + r.stderr[-2000:]


def test_a_collection_during_the_tcp_decode_may_resize_the_receive_buffer():
    # Python 3.11 collects inside an allocation of the C call (the decode's tuples), so a finalizer may
    # resize rbuf while the frame is split; ctrl_tcp_take must not then move bytes from the old memory
    # or drop what the finalizer added. Thresholds are scanned to land a collection inside the call.
    body = encode_control_binary(AFDControlPayload({0: [1, 2], 3: [4, 5]}))
    frame = struct.pack("<IIIQ", 0xAFDC7C01, 1, 7, len(body)) + body
    added = b"z" * (1 << 20)  # large: the bytearray's memory moves
    a, b = socket.socketpair()
    inside = 0
    old = gc.get_threshold()
    try:
        for threshold in range(1, 16):
            rbuf = bytearray(frame + b"REST")
            seen: list[int] = []
            in_call = [False]

            class Garbage:
                def __del__(self):
                    seen.append(len(rbuf) if in_call[0] else -1)
                    rbuf.extend(added)

            gc.collect()
            gc.set_threshold(threshold)
            g = Garbage()
            g.me = g
            del g
            in_call[0] = True
            got = _C.ctrl_tcp_take(a.fileno(), rbuf, 1 << 20, 0, 0, 16, 16)
            in_call[0] = False
            gc.set_threshold(*old)
            gc.collect()
            assert seen, "the garbage was not collected"
            assert got[:3] == (1, 7, len(body)) and got[3][4] == ((0, 2, (1, 2)), (3, 5, (4, 5))), got
            assert bytes(rbuf) == b"REST" + added, (threshold, seen, len(rbuf))
            inside += seen[0] == len(b"REST")  # collected in the call, after the frame left rbuf
    finally:
        gc.set_threshold(*old)
        a.close()
        b.close()
    if not inside:
        pytest.skip("no collection ran inside the native call (Python >= 3.12 collects between bytecodes)")
