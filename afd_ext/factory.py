"""Connector registry: by name, lazy import, third-party connectors via entry points.

Importing this module imports no torch and no connector: a registration stores
``(module_path, class_name)`` and the module is imported on first use.

Built-ins: ``"AfdExtConnector"`` -> ``afd_ext.connector:AFDConnector``, and
the reference's name ``"P2pNcclAFDConnector"`` as an alias of it, so a
reference configuration works unchanged.

Third-party connectors need no change to ``afd_ext``: declare an entry point
in the group ``afd_ext.connectors`` whose value is ``"pkg.mod:ClassName"``::

    # pyproject.toml of the third-party package
    [project.entry-points."afd_ext.connectors"]
    MyConnector = "my_pkg.connector:MyConnector"

or call :func:`register_connector` before the connector is created.

Construction contract: a connector class is called as
``cls(rank, local_rank, afd_config, role_rank=role_rank, **kwargs)``, where
``afd_config`` is an :class:`~afd_ext.config.AFDConfig`; a runtime config
object (e.g. vLLM's ``VllmConfig``) given to :func:`create_connector` is
passed on as the keyword ``vllm_config`` (the reference's name).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from dataclasses import dataclass
from typing import Any, Mapping

from .config import AFDConfig, DEFAULT_CONNECTOR, REFERENCE_CONNECTOR
from .errors import AFDConfigError
from .topology import validate_role_rank

logger = logging.getLogger(__name__)

#: Python entry-point group scanned for third-party connectors.
ENTRY_POINT_GROUP = "afd_ext.connectors"

#: Members a connector class must have (the reference's connector contract).
REQUIRED_CONNECTOR_METHODS = (
    "init_afd_connector",
    "close",
    "is_initialized",
    "send_attn_output",
    "recv_ffn_output",
    "recv_attn_output",
    "send_ffn_output",
)


@dataclass(frozen=True)
class _Spec:
    module_path: str
    class_name: str
    source: str  # "builtin", "register_connector" or "entry point of <dist>"


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise AFDConfigError(f"{what} must be a non-empty string, got {name!r}")
    return name


class AFDConnectorFactory:
    """Class-level connector registry (reference name). The module-level functions are its methods."""

    _registry: dict[str, _Spec] = {}
    _entry_points_loaded = False
    _lock = threading.RLock()

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str, *, replace: bool = False) -> None:
        """Register ``module_path.class_name`` under ``name``; imported on first use.

        Args:
            name: registry name (the value of the config field ``connector``).
            module_path: importable module, e.g. ``"my_pkg.connector"``.
            class_name: class in that module.
            replace: overwrite an existing registration.

        Raises:
            AFDConfigError: ``name`` is already registered and ``replace`` is False,
                or an argument is empty.
        """
        _check_name(name, "connector name")
        _check_name(module_path, "module_path")
        _check_name(class_name, "class_name")
        with cls._lock:
            if name in cls._registry and not replace:
                raise AFDConfigError(f"connector {name!r} is already registered")
            cls._registry[name] = _Spec(module_path, class_name, "register_connector")

    @classmethod
    def load_entry_points(cls) -> None:
        """Register every connector of the ``afd_ext.connectors`` entry-point group.

        Called lazily by lookups; names already registered win (a warning is
        logged). A malformed entry point value is logged and skipped.
        """
        with cls._lock:
            if cls._entry_points_loaded:
                return
            cls._entry_points_loaded = True
            try:
                eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
            except Exception as e:  # noqa: BLE001 - broken metadata must not break lookups
                logger.warning("could not read entry points of group %s: %s", ENTRY_POINT_GROUP, e)
                return
            for ep in eps:
                match = ep.pattern.match(ep.value)  # importlib's own grammar of 'pkg.module:attr'
                module_path, class_name = (match.group("module"), match.group("attr")) if match else ("", None)
                dist = getattr(getattr(ep, "dist", None), "name", None) or "unknown distribution"
                if not class_name or not class_name.isidentifier():
                    logger.warning(
                        "ignoring entry point %s = %r of %s: expected 'pkg.module:ClassName'", ep.name, ep.value, dist
                    )
                    continue
                existing = cls._registry.get(ep.name)
                if existing is not None:
                    if (existing.module_path, existing.class_name) != (module_path, class_name):
                        logger.warning(
                            "entry point %s = %r of %s ignored: the name is already registered (%s:%s, %s)",
                            ep.name, ep.value, dist, existing.module_path, existing.class_name, existing.source,
                        )
                    continue
                cls._registry[ep.name] = _Spec(module_path, class_name, f"entry point of {dist}")

    @classmethod
    def known_connectors(cls) -> tuple[str, ...]:
        """Sorted names of every registered connector (built-ins, registrations, entry points)."""
        cls.load_entry_points()
        with cls._lock:
            return tuple(sorted(cls._registry))

    @classmethod
    def get_connector_class(cls, name: str) -> type:
        """Import and return the class registered under ``name`` (Python caches the module).

        Raises:
            AFDConfigError: unknown name (the message lists the known names).
            ImportError: the module cannot be imported.
            TypeError: the attribute is missing, not a class, or lacks a
                member of the connector contract.
        """
        _check_name(name, "connector name")
        with cls._lock:
            spec = cls._registry.get(name)
        if spec is None:
            cls.load_entry_points()
            with cls._lock:
                spec = cls._registry.get(name)
        if spec is None:
            raise AFDConfigError(
                f"unsupported AFD connector type: {name!r}; known connectors: {list(cls.known_connectors())}. "
                f"Register one with afd_ext.factory.register_connector or an entry point in group "
                f"{ENTRY_POINT_GROUP!r}"
            )
        try:
            module = importlib.import_module(spec.module_path)
        except ImportError as e:
            raise ImportError(
                f"connector {name!r} ({spec.source}): cannot import module {spec.module_path!r}: {e}"
            ) from e
        klass = vars(module).get(spec.class_name)
        if klass is None:
            raise TypeError(f"connector {name!r}: module {spec.module_path!r} has no attribute {spec.class_name!r}")
        if not isinstance(klass, type):
            raise TypeError(f"{spec.module_path}.{spec.class_name} is not a class (connector {name!r})")
        missing = [m for m in REQUIRED_CONNECTOR_METHODS if not hasattr(klass, m)]
        if missing:
            raise TypeError(f"{spec.module_path}.{spec.class_name} is not an AFD connector: it lacks {missing}")
        return klass

    @classmethod
    def create_connector(
        cls,
        rank: int,
        local_rank: int,
        config: Any,
        afd_config: AFDConfig | Mapping[str, Any] | None = None,
        *,
        role_rank: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """Build the configured connector (no communication happens here).

        Accepts the reference's call ``create_connector(rank, local_rank,
        vllm_config, afd_config=None)`` as well as ``create_connector(rank,
        local_rank, afd_config)``.

        Args:
            rank: the runtime's world rank of this process.
            local_rank: CUDA device index of this process.
            config: an :class:`AFDConfig`, a mapping (the ``"afd"`` section),
                or a runtime config object; a runtime config supplies the AFD
                config through ``additional_config["afd"]`` unless
                ``afd_config`` is given, and is passed to the connector as
                ``vllm_config``.
            afd_config: the AFD config when ``config`` is a runtime config.
            role_rank: this process's index inside its role. Omitted: derived
                by :func:`resolve_role_rank` (as the reference's factory does)
                from a runtime config with ``parallel_config``, else 0 when the
                role has one rank.
            **kwargs: passed to the connector's constructor.

        Returns:
            The connector instance (not initialised; call ``init_afd_connector``).

        Raises:
            AFDConfigError: no AFD config found, unknown connector name, missing or
                out-of-range ``role_rank``.
            TypeError / ImportError: see :meth:`get_connector_class`.
        """
        runtime = None
        if afd_config is not None:
            runtime = config
            afd = _as_afd_config(afd_config)
        elif isinstance(config, (AFDConfig, Mapping)):
            afd = _as_afd_config(config)
        else:
            runtime = config
            additional = getattr(config, "additional_config", None)
            if not isinstance(additional, Mapping) or "afd" not in additional:
                raise AFDConfigError(
                    "no AFD config: pass an AFDConfig or a mapping, or a runtime config whose "
                    'additional_config has an "afd" section'
                )
            afd = AFDConfig.from_dict(additional["afd"])
        size = afd.num_attention_ranks if afd.role == "attention" else afd.num_ffn_ranks
        if role_rank is None and getattr(runtime, "parallel_config", None) is not None:
            role_rank = resolve_role_rank(runtime, afd)
        if role_rank is None:
            if size != 1:
                raise AFDConfigError(
                    f"role_rank is required: the {afd.role} role has {size} ranks; pass this process's "
                    f"index in 0..{size - 1}, or a VllmConfig-like object (with parallel_config) to derive "
                    "it from"
                )
            role_rank = 0
        validate_role_rank(afd.role, role_rank, afd.num_attention_ranks, afd.num_ffn_ranks)
        klass = cls.get_connector_class(afd.connector)
        if runtime is not None:
            kwargs.setdefault("vllm_config", runtime)
        return klass(rank, local_rank, afd, role_rank=role_rank, **kwargs)


def _parallel_size(pc: Any, name: str) -> int:
    value = getattr(pc, name, 1)
    value = 1 if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AFDConfigError(f"vllm_config.parallel_config.{name} must be an int >= 1, got {value!r}")
    return value


def _vllm_rank(getter: str, what: str) -> int:
    """This worker's rank from vLLM's ``parallel_state`` (imported only when a size > 1 needs it)."""
    try:
        from vllm.distributed import parallel_state
    except ImportError as e:
        raise AFDConfigError(
            f"cannot derive the AFD role rank: {what} > 1 but vLLM's parallel_state is not importable ({e}); "
            "pass role_rank= explicitly"
        ) from None
    try:
        if getter == "pcp":
            return int(parallel_state.get_pcp_group().rank_in_group)
        return int(parallel_state.get_tensor_model_parallel_rank())
    except Exception as e:  # noqa: BLE001 - vLLM raises AssertionError before its groups exist
        raise AFDConfigError(
            f"cannot derive the AFD role rank: vLLM's {what} group is not initialised yet ({type(e).__name__}: {e}); "
            "create the connector after vLLM's distributed init, or pass role_rank="
        ) from None


def resolve_role_rank(vllm_config: Any, afd_config: AFDConfig) -> int:
    """This worker's role rank, the reference's rule: ``(dp_rank * pcp_size + pcp_rank) * tp_size + tp_rank``.

    Sizes and the global DP rank (``data_parallel_rank``, which already
    includes ``data_parallel_start_rank``) come from
    ``vllm_config.parallel_config``; the PCP and TP ranks from vLLM's
    ``parallel_state`` (``get_pcp_group().rank_in_group``,
    ``get_tensor_model_parallel_rank()``), read only when that size is > 1.
    The config holds no per-worker TP rank, so taking it from there would
    give every TP worker the same role rank.

    Raises:
        AFDConfigError: no ``parallel_config``, a size that is not an int >= 1,
            vLLM's ranks not available while a size > 1 needs them, or a
            role rank outside the role's size (sizes named in the message).
    """
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None:
        raise AFDConfigError(
            "cannot derive the AFD role rank: the runtime config has no parallel_config "
            "(expected a vLLM VllmConfig); pass role_rank= explicitly"
        )
    dp = _parallel_size(pc, "data_parallel_size")
    pcp = _parallel_size(pc, "prefill_context_parallel_size")
    tp = _parallel_size(pc, "tensor_parallel_size")
    dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0) if dp > 1 else 0
    pcp_rank = _vllm_rank("pcp", "prefill_context_parallel_size") if pcp > 1 else 0
    tp_rank = _vllm_rank("tp", "tensor_parallel_size") if tp > 1 else 0
    role_rank = (dp_rank * pcp + pcp_rank) * tp + tp_rank
    size = afd_config.num_attention_ranks if afd_config.role == "attention" else afd_config.num_ffn_ranks
    if not 0 <= role_rank < size:
        raise AFDConfigError(
            f"AFD role rank derived from distributed ranks is out of range: role={afd_config.role!r}, "
            f"dp_rank={dp_rank}, pcp_rank={pcp_rank}, tp_rank={tp_rank} (sizes dp={dp}, pcp={pcp}, tp={tp}) "
            f"give {role_rank}, but the {afd_config.role} role has {size} ranks "
            f"(num_{'attention' if afd_config.role == 'attention' else 'ffn'}_ranks must be dp x pcp x tp)"
        )
    return role_rank


def _as_afd_config(value: Any) -> AFDConfig:
    if isinstance(value, AFDConfig):
        return value
    if isinstance(value, Mapping):
        return AFDConfig.from_dict(value)
    raise TypeError(f"afd_config must be an AFDConfig or a mapping, got {type(value).__name__}")


for _name in (DEFAULT_CONNECTOR, REFERENCE_CONNECTOR):
    AFDConnectorFactory._registry[_name] = _Spec("afd_ext.connector", "AFDConnector", "builtin")


# The module-level API is the class's: one implementation, two spellings (the reference's is the class).
register_connector = AFDConnectorFactory.register_connector
get_connector_class = AFDConnectorFactory.get_connector_class
create_connector = AFDConnectorFactory.create_connector
known_connectors = AFDConnectorFactory.known_connectors
