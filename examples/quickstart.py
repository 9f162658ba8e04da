"""The smallest complete AFD exchange: 2 attention ranks, 1 FFN rank, CPU tensors over gloo.

Run it with ``python examples/quickstart.py``. Each process builds the
connector from the reference-compatible config; the attention ranks run a
two-layer "model" whose MLP is remote; the FFN rank serves it. Every attention
rank checks that it got back exactly its own rows transformed. With CUDA
tensors and ``"transport": "nccl"`` the same code runs over NCCL. This script
starts its own processes; ``examples/multinode.py`` is the same exchange
started by a launcher (``afd-ext launch``, torchrun), on one host or several.
"""

from __future__ import annotations

import torch

from afd_ext.config import AFDConfig
from afd_ext.factory import create_connector
from afd_ext.metadata import AFDControlPayload, AFDTransferContext, AFDTransferMetadata
from afd_ext.testing import find_free_port, run_workers

A, F, HIDDEN, LAYERS = 2, 1, 16, 2
STEPS = [[3, 5], [0, 4], [2, 0]]  # per-step token counts of attention ranks 0 and 1 (zero is fine)


def ffn(layer: int, h: torch.Tensor) -> torch.Tensor:
    return h * (layer + 2) + 1.0


def worker(rank: int, nprocs: int, port: int) -> int:
    role = "ffn" if rank < F else "attention"  # AFD world order: FFN ranks first
    role_rank = rank if role == "ffn" else rank - F
    cfg = AFDConfig.from_dict({
        "role": role, "host": "127.0.0.1", "port": port,
        "num_attention_ranks": A, "num_ffn_ranks": F,
        "connector_extra_config": {"transport": "gloo", "step_timeout_s": 30},
    })
    conn = create_connector(rank, 0, cfg, role_rank=role_rank, hidden_size=HIDDEN, num_layers=LAYERS,
                            dtype=torch.float32, device=torch.device("cpu"))
    conn.init_afd_connector()  # collective: store on FFN rank 0, handshake, warm-up
    try:
        for step, counts in enumerate(STEPS):
            payload = AFDControlPayload(dp_metadata_list={0: counts})
            if role == "ffn":
                got = conn.control_plane.recv_dp_metadata_list()
                conn.control_plane.update_state_from_dp_metadata(got)
                for layer in range(LAYERS):
                    a2f = conn.recv_attn_output(ubatch_idx=0)  # fan-in of every peer's rows
                    conn.send_ffn_output(ffn(layer, a2f.hidden_states), a2f.context)  # split-back
            else:
                conn.control_plane.update_state_from_dp_metadata(payload)
                conn.control_plane.send_dp_metadata_list(payload)  # no-op on non-sender ranks
                n = counts[role_rank]
                h = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(step * 10 + role_rank))
                expected = h.clone()
                for layer in range(LAYERS):
                    ctx = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(
                        layer_idx=layer, stage_idx=0, seq_len=n))
                    conn.send_attn_output(h, ctx)
                    h = conn.recv_ffn_output(h, ubatch_idx=0)  # the reply lands in h
                    expected = ffn(layer, expected)
                torch.testing.assert_close(h, expected)
        return len(STEPS)
    finally:
        conn.close()


if __name__ == "__main__":
    done = run_workers(worker, A + F, (find_free_port(),), timeout_s=120)
    print(f"quickstart: {A}A{F}F, {done[0]} steps, every attention rank got back exactly its rows")
