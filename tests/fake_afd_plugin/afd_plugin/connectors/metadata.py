"""The reference's metadata types (``afd_plugin/connectors/metadata.py``), without the vLLM import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


@dataclass(slots=True)
class AFDDPMetadata:
    num_tokens_across_dp_cpu: torch.Tensor
    max_tokens_across_dp_cpu: torch.Tensor | None = None
    local_sizes: list[int] | None = None

    def __post_init__(self) -> None:
        self.num_tokens_across_dp_cpu = torch.as_tensor(self.num_tokens_across_dp_cpu, dtype=torch.int32,
                                                        device="cpu")
        if self.max_tokens_across_dp_cpu is None:
            self.max_tokens_across_dp_cpu = self.num_tokens_across_dp_cpu.max()
        else:
            self.max_tokens_across_dp_cpu = torch.as_tensor(self.max_tokens_across_dp_cpu, dtype=torch.int32,
                                                            device="cpu")


@dataclass(slots=True)
class AFDControlPayload:
    dp_metadata_list: dict[int, Any]
    is_graph_capturing: bool
    is_warmup: bool

    def __post_init__(self) -> None:
        # The real class converts vLLM DPMetadata values here (only the counts survive).
        self.dp_metadata_list = {
            s: md if hasattr(md, "max_tokens_across_dp_cpu") else AFDDPMetadata(md.num_tokens_across_dp_cpu)
            for s, md in self.dp_metadata_list.items()
        }


@dataclass(slots=True)
class AFDTransferState:
    pass


class AFDExpertRoutingSpec(NamedTuple):
    router_logits_width: int
    router_logits_dtype: torch.dtype


@dataclass(slots=True)
class AFDTransferMetadata:
    layer_idx: int
    stage_idx: int
    seq_lens: list[int]

    def __post_init__(self) -> None:
        if not self.seq_lens:
            raise ValueError("seq_lens cannot be empty")
        if any(n <= 0 for n in self.seq_lens):
            raise ValueError("all sequence lengths must be positive")

    @property
    def total_tokens(self) -> int:
        return sum(self.seq_lens)

    @classmethod
    def create_attention_metadata(cls, *, layer_idx: int, stage_idx: int, seq_len: int) -> "AFDTransferMetadata":
        return cls(layer_idx=layer_idx, stage_idx=stage_idx, seq_lens=[seq_len])

    @classmethod
    def create_ffn_metadata(cls, *, layer_idx: int, stage_idx: int, seq_lens: list[int]) -> "AFDTransferMetadata":
        return cls(layer_idx=layer_idx, stage_idx=stage_idx, seq_lens=list(seq_lens))

    def validate_tensor_shape(self, tensor_shape: tuple[int, ...]) -> bool:
        return len(tensor_shape) > 0 and tensor_shape[0] == self.total_tokens


@dataclass(slots=True)
class AFDTransferContext:
    metadata: AFDTransferMetadata
    states: AFDTransferState | None = None


@dataclass(slots=True)
class AFDA2FTransferPayload:
    hidden_states: torch.Tensor
    context: AFDTransferContext
    router_logits: torch.Tensor | None = None


@dataclass(slots=True)
class AFDForwardContextMetadata:
    tokens_start_loc: list[int]
    requests_start_loc: list[int]
    stage_idx: int
    connector: Any
    tokens_lens: list[int]
    num_stages: int
    transaction_id: str | None = None
    tokens_unpadded_lens: list[int] = field(default_factory=list)
