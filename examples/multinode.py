"""AFD under torchrun: 2 attention ranks and 1 FFN rank, on one host or across hosts.

Every process is started by a launcher; :func:`afd_ext.tools.launch.config_from_env`
turns torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` into the AFD role,
role rank and rendezvous address (FFN ranks first: rank 0 is FFN rank 0, which
hosts the AFD store). The attention ranks run four steps of a two-layer
"model" whose MLP is remote, with two stages (micro-batches) and ranks that
have no tokens in some steps; each checks that it got back exactly its own rows
transformed. CPU tensors over gloo by default (``--transport nccl``: CUDA).

One host (3 processes)::

    afd-ext launch -A 2 -F 1 -- python examples/multinode.py
    AFD_NUM_FFN_RANKS=1 torchrun --standalone --nproc-per-node 3 examples/multinode.py

Two hosts: the FFN rank on host 1 (address 10.0.0.1), the attention ranks on
host 2. Node rank 0 is the FFN host, so torchrun's ``MASTER_ADDR`` is FFN rank
0's address (port 1239 must be open on host 1 for the AFD store, 29500 for
torchrun's). Give both hosts the same ``--rdzv-id``, unique per job: with this
static rendezvous torchrun's default run id is the literal ``none``, and the
AFD store uses it to refuse another job's ranks (docs/multi-node.md, "Job
identity")::

    host1$ AFD_NUM_FFN_RANKS=1 torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 \\
               --master-addr 10.0.0.1 --master-port 29500 --rdzv-id afd-job-42 examples/multinode.py
    host2$ AFD_NUM_FFN_RANKS=1 torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 \\
               --master-addr 10.0.0.1 --master-port 29500 --rdzv-id afd-job-42 examples/multinode.py

Each rank prints one line: its role, its host name, and the steps and rows it checked.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch

from afd_ext.factory import create_connector
from afd_ext.tools.launch import config_from_env, local_device
from afd_ext.metadata import AFDControlPayload, AFDTransferContext, AFDTransferMetadata

HIDDEN, LAYERS = 16, 2


def steps(A: int) -> list[dict[int, list[int]]]:
    """Per step, ``{stage: token count of each attention rank}``: zero-token ranks, two stages, an idle step."""
    return [
        {0: [3 + a for a in range(A)]},
        {0: [0 if a % 2 else 4 for a in range(A)], 1: [a % 3 for a in range(A)]},
        {0: [0] * A},
        {0: [2] * A, 1: [1 + a for a in range(A)]},
    ]


def ffn(layer: int, h: torch.Tensor) -> torch.Tensor:
    """The FFN side's "model" (elementwise, so each rank can check its own rows)."""
    return h * (layer + 2) + 1.0


def serve_ffn(conn, n_steps: int) -> int:
    rows = 0
    for _ in range(n_steps):
        payload = conn.control_plane.recv_dp_metadata_list()  # the step's per-rank counts
        conn.control_plane.update_state_from_dp_metadata(payload)
        for layer in range(LAYERS):
            for stage in sorted(payload.dp_metadata_list):
                a2f = conn.recv_attn_output(ubatch_idx=stage)  # fan-in of every attention rank's rows
                conn.send_ffn_output(ffn(layer, a2f.hidden_states), a2f.context)  # split-back
                rows += a2f.hidden_states.shape[0] if layer == 0 else 0
        conn.synchronize()  # NCCL: the step's replies have left (bounded: a lost peer is a named error)
    return rows


def run_attention(conn, role_rank: int, plan: list[dict[int, list[int]]], device: torch.device) -> int:
    rows = 0
    for step, counts in enumerate(plan):
        payload = AFDControlPayload(dp_metadata_list=counts)
        conn.control_plane.update_state_from_dp_metadata(payload)
        conn.control_plane.send_dp_metadata_list(payload)  # a no-op on ranks that are not control senders
        gen = torch.Generator().manual_seed(100 * step + role_rank)
        h = {s: torch.randn(c[role_rank], HIDDEN, generator=gen).to(device) for s, c in counts.items()}
        want = {s: t.clone() for s, t in h.items()}
        for layer in range(LAYERS):
            for stage, x in h.items():  # every stage goes out before the first reply is awaited
                ctx = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(
                    layer_idx=layer, stage_idx=stage, seq_len=x.shape[0]))
                conn.send_attn_output(x, ctx)
            for stage, x in h.items():
                conn.recv_ffn_output(x, ubatch_idx=stage)  # the reply lands in x
                want[stage] = ffn(layer, want[stage])
        conn.synchronize()  # NCCL: the replies have landed (bounded, as above)
        for stage, x in h.items():
            torch.testing.assert_close(x, want[stage], rtol=0, atol=0)
            rows += x.shape[0]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", choices=("gloo", "nccl"), default="gloo")
    args = p.parse_args()
    role, role_rank, cfg = config_from_env(connector_extra_config={"transport": args.transport})
    device = torch.device("cpu") if args.transport == "gloo" else torch.device("cuda", local_device() or 0)
    conn = create_connector(int(os.environ.get("RANK", 0)), device.index or 0, cfg, role_rank=role_rank, hidden_size=HIDDEN, num_layers=LAYERS,
                            dtype=torch.float32, device=device)
    conn.init_afd_connector()  # collective: store on FFN rank 0, handshake, control channels, warm-up
    try:
        plan = steps(cfg.num_attention_ranks)
        rows = serve_ffn(conn, len(plan)) if role == "ffn" else run_attention(conn, role_rank, plan, device)
        print(f"multinode example: {role} rank {role_rank} on {socket.gethostname()}: {len(plan)} steps, "
              f"{rows} rows exact", flush=True)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
