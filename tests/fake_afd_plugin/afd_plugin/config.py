"""The reference's ``AFDConfig``: fields, aliases, and ``validate_afd_config`` (allow-list, P2P topology)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

SUPPORTED_AFD_CONNECTORS = ("P2pNcclAFDConnector", "CAMP2pAFDConnector", "CAMAsyncAFDConnector")
_ALIASES = {"afd_connector": "connector", "afd_role": "role", "afd_port": "port", "afd_host": "host",
            "async": "async_dp"}


@dataclass(frozen=True)
class AFDConfig:
    connector: str = "P2pNcclAFDConnector"
    async_dp: bool = False
    role: str = "attention"
    port: int = 1239
    host: str = "127.0.0.1"
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    compute_gate_on_attention: bool = False

    @property
    def is_attention_server(self) -> bool:
        return self.role == "attention"

    @property
    def is_ffn_server(self) -> bool:
        return self.role == "ffn"


def _afd_section(source: Any) -> Mapping[str, Any] | None:
    extra = source if isinstance(source, Mapping) else getattr(source, "additional_config", None)
    if extra is None or "afd" not in extra:
        return None
    return extra["afd"]


def _split(raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    known = {f.name for f in fields(AFDConfig)}
    out: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        name = _ALIASES.get(key, key)
        if name == "connector_extra_config":
            if not isinstance(value, Mapping):
                raise TypeError(f"{key} must be a mapping")
            extra = dict(value)
            continue
        if name not in known:
            raise ValueError(f"unknown AFD config field {key!r}; put connector-specific values under "
                             "'connector_extra_config'")
        if name in out:
            raise ValueError(f"duplicate AFD config field for {name!r}")
        out[name] = value
    return out, extra


def connector_extra_config_from_source(source: Any) -> dict[str, Any]:
    raw = _afd_section(source)
    return {} if raw is None else _split(raw)[1]


def validate_afd_config(config: AFDConfig, *, expected_role: str | None = None) -> None:
    if config.role not in ("attention", "ffn"):
        raise ValueError(f"AFD role must be one of ('attention', 'ffn'), got {config.role!r}")
    if expected_role is not None and config.role != expected_role:
        raise ValueError(f"AFD role mismatch: expected {expected_role!r}, got {config.role!r}")
    if config.connector not in SUPPORTED_AFD_CONNECTORS:
        raise ValueError(f"AFD connector must be one of {SUPPORTED_AFD_CONNECTORS!r}, got {config.connector!r}")
    if config.connector == "P2pNcclAFDConnector":
        from afd_plugin.distributed import validate_p2p_topology

        validate_p2p_topology(config)
    if not 0 < config.port < 65536:
        raise ValueError(f"AFD port must be in 1..65535, got {config.port}")


def parse_afd_config(source: Any, *, validate: bool = True, expected_role: str | None = None) -> AFDConfig:
    raw = _afd_section(source)
    if raw is None:
        raise ValueError('AFD config requires additional_config["afd"]; omit it to disable AFD')
    config = AFDConfig(**_split(raw)[0])
    if validate:
        validate_afd_config(config, expected_role=expected_role)
    return config
