"""The reference's topology checks and role-rank rule (``afd_plugin/distributed/topology.py``)."""

from __future__ import annotations

from typing import Any


def validate_p2p_topology(config: Any) -> None:
    a, f = config.num_attention_ranks, config.num_ffn_ranks
    if a < f:
        raise ValueError(f"P2pNcclAFDConnector currently requires num_attention_ranks >= num_ffn_ranks, "
                         f"got {a} < {f}")
    if a % f:
        raise ValueError(f"P2pNcclAFDConnector currently requires num_attention_ranks to be a multiple of "
                         f"num_ffn_ranks, got {a} and {f}")


def resolve_role_rank(vllm_config: Any, config: Any) -> int:
    """``(dp_rank * pcp_size + pcp_rank) * tp_size + tp_rank``; PCP/TP ranks from vLLM's parallel_state."""
    pc = vllm_config.parallel_config
    dp, pcp, tp = int(pc.data_parallel_size), int(pc.prefill_context_parallel_size), int(pc.tensor_parallel_size)
    dp_rank = int(pc.data_parallel_rank) if dp > 1 else 0
    pcp_rank = tp_rank = 0
    if pcp > 1:
        from vllm.distributed.parallel_state import get_pcp_group

        pcp_rank = int(get_pcp_group().rank_in_group)
    if tp > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = int(get_tensor_model_parallel_rank())
    role_rank = (dp_rank * pcp + pcp_rank) * tp + tp_rank
    size = config.num_attention_ranks if config.role == "attention" else config.num_ffn_ranks
    if not 0 <= role_rank < size:
        raise ValueError(f"AFD role rank derived from distributed ranks is out of range: role={config.role!r}, "
                         f"dp_rank={dp_rank}, pcp_rank={pcp_rank}, tp_rank={tp_rank}, role_size={size}")
    return role_rank
