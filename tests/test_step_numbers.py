"""Step numbers in messages count the caller's steps: the connector's own warm-up steps are not counted."""

from __future__ import annotations

import pytest
import torch

from afd_ext.config import AFDConfig
from afd_ext.connector.sequencer import StepSequencer
from afd_ext.factory import create_connector
from afd_ext.metadata import AFDControlPayload, AFDTransferContext, AFDTransferMetadata
from afd_ext.tools.testing import find_free_port, run_workers
from afd_ext.topology import step_words
from afd_ext.transport.base import MessageTag, StepProgress


def test_step_words():
    assert step_words(1) == "step 1" and step_words(12) == "step 12"
    assert step_words(0) == "warm-up step" and step_words(-1) == "no step"


def test_tags_and_sequencer_name_the_callers_step():
    # Ordinal 3 (one init warm-up, then the caller's steps 1 and 2): messages say "step 2".
    assert MessageTag("recv_ffn_output", "f2a", 3, 1, 0, user_step=2).where() == "step 2, layer 1, stage 0"
    assert MessageTag("warmup", "a2f", 1, 0, 0, user_step=0).where() == "warm-up step, layer 0, stage 0"
    assert MessageTag("synchronize", "a2f", 3, -1, -1, user_step=2).where() == "step 2"
    assert MessageTag("x", "a2f", 3, 0, 0).where() == "step 3, layer 0, stage 0"  # no user number: the ordinal
    seq = StepSequencer(3, "attention", [(0, 0), (1, 0)], "attention rank 0", user_step=2)
    assert seq.step == 3 and seq.label == "step 2" and seq.where(1) == "step 2, layer 1, stage 0"
    assert StepProgress(3, 2, 0, 0, False, ((0, 0),), "", 0.0, user_step=2).user_step == 2


def test_stall_report_names_the_peers_step():
    from afd_ext.health.stall import _label

    assert _label({"step": 3, "user_step": 2}) == "step 2"
    assert _label({"step": 1, "user_step": 0}) == "warm-up step"
    assert _label({"step": 4}) == "step 4"  # a report without the caller's number


def test_strict_header_shows_the_callers_step():
    from afd_ext.transport.strict import _describe_header, encode_headers

    tag = MessageTag("send_attn_output", "a2f", 3, 1, 0, user_step=2)
    rows = encode_headers(tag, 1, 0, 4, [torch.zeros(4, 8)])
    assert "step 2, layer 1, stage 0" in _describe_header(rows[0].tolist(), str)


H, L = 8, 2


def _worker(rank: int, nprocs: int, port: int) -> str:
    role = "ffn" if rank == 0 else "attention"
    cfg = AFDConfig.from_dict({"role": role, "host": "127.0.0.1", "port": port, "num_attention_ranks": 1,
                               "num_ffn_ranks": 1,
                               "connector_extra_config": {"transport": "gloo", "step_timeout_s": 30}})
    conn = create_connector(rank, 0, cfg, role_rank=0, hidden_size=H, num_layers=L, dtype=torch.float32,
                            device=torch.device("cpu"))
    conn.init_afd_connector()  # runs the connector's warm-up step (warmup_on_init)
    try:
        payload = AFDControlPayload(dp_metadata_list={0: [3]})
        for _ in range(2):  # the caller's steps 1 and 2
            if role == "ffn":
                conn.control_plane.update_state_from_dp_metadata(conn.control_plane.recv_dp_metadata_list())
                for _layer in range(L):
                    a2f = conn.recv_attn_output(ubatch_idx=0)
                    conn.send_ffn_output(a2f.hidden_states.clone(), a2f.context)
            else:
                conn.control_plane.update_state_from_dp_metadata(payload)
                conn.control_plane.send_dp_metadata_list(payload)
                h = torch.ones(3, H)
                for layer in range(L):
                    ctx = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(
                        layer_idx=layer, stage_idx=0, seq_len=3))
                    conn.send_attn_output(h, ctx)
                    h = conn.recv_ffn_output(h, ubatch_idx=0)
        if role == "ffn":
            return ""
        try:  # one exchange too many in the caller's second step
            conn.send_attn_output(h, ctx)
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            return str(e)
        return "no error"
    finally:
        conn.close()


@pytest.mark.timeout(120)
def test_the_callers_second_step_is_step_2_after_the_init_warmup():
    _, msg = run_workers(_worker, 2, (find_free_port(),), timeout_s=100)
    assert "all 2 exchanges of step 2 were already sent" in msg, msg
