"""The torchrun example over NCCL as two "hosts" on the GPU machine (GPU tier).

Two torchrun agents on one machine, each with its own ``NCCL_HOSTID``: NCCL
then treats them as two hosts and connects every attention-FFN communicator
over its network (socket) transport, the path it takes between machines. The
FFN agent (node rank 0, the store host) runs FFN rank 0, the other agent the
two attention ranks; with two GPUs the FFN rank gets GPU 1, with one GPU every
process shares GPU 0 (no communicator joins two processes of one agent, so one
host id per agent suffices).

Run on the GPU machine::

    pytest -m gpu tests/gpu/test_multinode_gpu.py -v
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_LINE = re.compile(r"multinode example: (\w+) rank (\d+) on \S+: 4 steps, (\d+) rows exact")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_example_over_nccl_as_two_torchrun_hosts():
    from afd_ext.tools.testing import find_free_port

    base = {k: v for k, v in os.environ.items() if not k.startswith("AFD_") and k not in ("RANK", "WORLD_SIZE")}
    base.update(PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), AFD_NUM_FFN_RANKS="1",
                AFD_PORT=str(find_free_port()), AFD_DEVICE="0", OMP_NUM_THREADS="1")
    master_port = find_free_port()
    ffn_gpu = "1" if torch.cuda.device_count() >= 2 else "0"
    procs, logs = [], [tempfile.TemporaryFile("w+") for _ in range(2)]
    try:
        for node_rank, nproc, gpu in ((0, 1, ffn_gpu), (1, 2, "0")):
            env = dict(base, CUDA_VISIBLE_DEVICES=gpu, NCCL_HOSTID=f"afd-node-{node_rank}")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
                 "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(master_port),
                 str(REPO / "examples" / "multinode.py"), "--transport", "nccl"],
                stdout=logs[node_rank], stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                start_new_session=True))
        for p in procs:
            p.wait(timeout=240)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGTERM first: torchrun then stops its ranks
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, sig)
                    try:
                        p.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        pass
        outs = []
        for log in logs:
            log.seek(0)
            outs.append(log.read())
            log.close()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    got = {(m[0], int(m[1])): int(m[2]) for m in EXAMPLE_LINE.findall("".join(outs))}
    assert got == {("ffn", 0): 19, ("attention", 0): 10, ("attention", 1): 9}, "\n".join(outs)
