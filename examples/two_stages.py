"""Two stages per step, router logits and token ids, zero-token ranks: 2 attention ranks, 1 FFN rank, over gloo.

Run it with ``python examples/two_stages.py``. It extends ``quickstart.py``
with everything a MoE model with the gate on the attention side sends:

* **router logits** ``[rows, EXPERTS]`` float32 and **token ids** ``[rows]``
  int32 travel attention -> FFN with the hidden states (declared once, at
  construction: ``router_logits_width``, ``router_logits_dtype``,
  ``send_token_ids``; both roles must agree, the init handshake checks it);
* **two stages** (micro-batches) per step: the payload's ``dp_metadata_list``
  maps each stage to every attention rank's token count, and every layer
  exchanges stage 0 then stage 1; both sends are in flight before the first
  reply is collected;
* **zero-token ranks**: an attention rank with no tokens in a stage still
  makes its calls, with ``[0, H]`` tensors, and sends nothing; a stage in
  which no rank has tokens is still an exchange on every rank.

The FFN rank receives every peer's rows, logits and ids concatenated
(``recv_attn_output``), and its reply uses all three, so each attention rank
can check bit for bit that its own rows, logits and ids arrived and that it
got back exactly its rows.
"""

from __future__ import annotations

import torch

from afd_ext.config import AFDConfig
from afd_ext.factory import create_connector
from afd_ext.metadata import AFDControlPayload, AFDTransferContext, AFDTransferMetadata
from afd_ext.testing import find_free_port, run_workers

A, F, HIDDEN, LAYERS, EXPERTS = 2, 1, 16, 2, 4
# Per step: stage -> token counts of attention ranks 0 and 1 (zeros are fine).
STEPS = [
    {0: [3, 5], 1: [2, 0]},
    {0: [0, 4], 1: [6, 1]},
    {0: [1, 1], 1: [0, 3]},
    {0: [2, 3], 1: [0, 0]},  # a stage without tokens is still an exchange, with empty tensors
]


def ffn(layer: int, h: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Stands in for the MoE layer; uses the logits and the ids so the replies prove they arrived."""
    return h * (layer + 2) + logits.sum(dim=-1, keepdim=True) + ids.unsqueeze(-1).to(h.dtype)


def inputs(step: int, stage: int, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention rank's hidden states, router logits and token ids for one stage (seeded)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * stage + rank)
    h = torch.randn(n, HIDDEN, generator=g)
    logits = torch.randn(n, EXPERTS, generator=g)
    ids = torch.randint(0, 32000, (n,), generator=g, dtype=torch.int32)
    return h, logits, ids


def worker(rank: int, nprocs: int, port: int) -> int:
    role = "ffn" if rank < F else "attention"  # AFD world order: FFN ranks first
    role_rank = rank if role == "ffn" else rank - F
    cfg = AFDConfig.from_dict({
        "role": role, "host": "127.0.0.1", "port": port,
        "num_attention_ranks": A, "num_ffn_ranks": F, "compute_gate_on_attention": True,
        "connector_extra_config": {"transport": "gloo", "step_timeout_s": 30, "max_stages": 2},
    })
    conn = create_connector(rank, 0, cfg, role_rank=role_rank, hidden_size=HIDDEN, num_layers=LAYERS,
                            dtype=torch.float32, device=torch.device("cpu"),
                            router_logits_width=EXPERTS, router_logits_dtype=torch.float32, send_token_ids=True)
    conn.init_afd_connector()  # collective: store on FFN rank 0, handshake (facts must agree), warm-up
    try:
        for step, counts in enumerate(STEPS):
            stages = sorted(counts)
            if role == "ffn":
                conn.control_plane.update_state_from_dp_metadata(conn.control_plane.recv_dp_metadata_list())
                for layer in range(LAYERS):
                    for stage in stages:  # the order the attention side sends: layer-major, stage-minor
                        a2f = conn.recv_attn_output(ubatch_idx=stage)  # every peer's rows, fan-in order
                        reply = ffn(layer, a2f.hidden_states, a2f.router_logits, a2f.input_ids)
                        conn.send_ffn_output(reply, a2f.context)  # split back: each peer gets its rows
            else:
                payload = AFDControlPayload(dp_metadata_list=counts)
                conn.control_plane.update_state_from_dp_metadata(payload)
                conn.control_plane.send_dp_metadata_list(payload)  # no-op on non-sender ranks
                own = {s: inputs(step, s, role_rank, counts[s][role_rank]) for s in stages}
                h = {s: own[s][0].clone() for s in stages}
                expected = {s: own[s][0].clone() for s in stages}
                for layer in range(LAYERS):
                    for stage in stages:  # both stages in flight before the first reply is collected
                        n = counts[stage][role_rank]
                        ctx = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(
                            layer_idx=layer, stage_idx=stage, seq_len=n))
                        conn.send_attn_output(h[stage], ctx, router_logits=own[stage][1], input_ids=own[stage][2])
                    for stage in stages:  # oldest exchange first
                        h[stage] = conn.recv_ffn_output(h[stage], ubatch_idx=stage)
                        expected[stage] = ffn(layer, expected[stage], own[stage][1], own[stage][2])
                for stage in stages:
                    torch.testing.assert_close(h[stage], expected[stage], rtol=0, atol=0)
        return len(STEPS)
    finally:
        conn.close()


if __name__ == "__main__":
    done = run_workers(worker, A + F, (find_free_port(),), timeout_s=120)
    print(f"two_stages: {A}A{F}F, 2 stages, router logits [n, {EXPERTS}] + token ids, {done[0]} steps with "
          "zero-token ranks; every attention rank got back exactly its rows")
