"""The reference's connector contract: ``AFDConnectorBase`` (abstract), ``AFDControlPlane``, ``ConnectorExtraInfo``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from afd_plugin.config import connector_extra_config_from_source


@dataclass(frozen=True)
class ConnectorExtraInfo:
    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> "ConnectorExtraInfo":
        raise NotImplementedError

    def to_mapping(self) -> dict[str, Any]:
        return {}


class AFDConnectorBase(ABC):
    control_plane: "AFDControlPlane | None" = None
    attn_size: int = 0
    ffn_size: int = 0

    @classmethod
    @abstractmethod
    def parse_extra_config(cls, raw: Mapping[str, Any] | None) -> ConnectorExtraInfo: ...

    def __init__(self, rank: int, local_rank: int, vllm_config: Any, afd_config: Any, role_rank: int) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.vllm_config = vllm_config
        self.afd_config = afd_config
        self.role_rank = role_rank
        self.extra_info = self.parse_extra_config(connector_extra_config_from_source(vllm_config))

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def init_afd_connector(self) -> None: ...

    @property
    @abstractmethod
    def is_initialized(self) -> bool: ...

    @abstractmethod
    def send_attn_output(self, hidden_states, context, **kwargs) -> None: ...

    @abstractmethod
    def recv_ffn_output(self, ref_tensor, ubatch_idx: int = 0, **kwargs): ...

    @abstractmethod
    def recv_attn_output(self, ubatch_idx: int = 0, **kwargs): ...

    @abstractmethod
    def send_ffn_output(self, ffn_output, context, **kwargs) -> None: ...


class AFDControlPlane(ABC):
    @abstractmethod
    def update_state_from_dp_metadata(self, payload) -> None: ...

    @abstractmethod
    def send_dp_metadata_list(self, payload) -> None: ...

    @abstractmethod
    def recv_dp_metadata_list(self): ...
