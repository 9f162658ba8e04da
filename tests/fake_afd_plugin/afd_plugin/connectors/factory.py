"""The reference's ``AFDConnectorFactory``: lazy loader with a subclass check, the reference constructor call."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from afd_plugin.config import parse_afd_config
from afd_plugin.connectors.base import AFDConnectorBase
from afd_plugin.distributed import resolve_role_rank


class AFDConnectorFactory:
    _registry: dict[str, Callable[[], type]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str, *, replace: bool = False) -> None:
        if name in cls._registry and not replace:
            raise ValueError(f"connector {name!r} is already registered")

        def loader() -> type:
            klass = vars(importlib.import_module(module_path))[class_name]
            if not issubclass(klass, AFDConnectorBase):
                raise TypeError(f"{module_path}.{class_name} is not an AFDConnectorBase")
            return klass

        cls._registry[name] = loader

    @classmethod
    def create_connector(cls, rank: int, local_rank: int, vllm_config: Any, afd_config: Any = None):
        config = afd_config or parse_afd_config(vllm_config)
        if config.connector not in cls._registry:
            raise ValueError(f"unsupported AFD connector type: {config.connector}")
        klass = cls._registry[config.connector]()
        return klass(rank, local_rank, vllm_config, config, resolve_role_rank(vllm_config, config))

    @classmethod
    def get_connector_class(cls, name: str) -> type:
        if name not in cls._registry:
            raise ValueError(f"unsupported AFD connector type: {name}")
        return cls._registry[name]()


# Built-ins (their modules are not part of this stand-in: loading one fails, as without CUDA/NPU).
for _name, _mod in (("P2pNcclAFDConnector", "afd_plugin.connectors.gpu.p2p"),
                    ("CAMP2pAFDConnector", "afd_plugin.connectors.npu.camp2p"),
                    ("CAMAsyncAFDConnector", "afd_plugin.connectors.npu.async_cam")):
    AFDConnectorFactory.register_connector(_name, _mod, _name)
