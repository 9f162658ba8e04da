"""The one module that reads ``AFD_*`` environment variables.

Every variable is declared once here with its default and meaning, and read
through :func:`get`, so ``python -m afd_ext info`` (or :func:`describe`) can
list them all. To add one, append a ``register(...)`` line below.

``setup.py`` cannot import the package before it is built, so it parses the
build-time variables (``AFD_USE_CUDA``) itself; they are declared here too so
the list is complete.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from .errors import AFDConfigError


def parse_bool(value: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off/""`` -> False (case-insensitive).

    Raises:
        AFDConfigError: any other value.
    """
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise AFDConfigError(f"expected a boolean (0/1, true/false), got {value!r}")


@dataclass(frozen=True)
class EnvVar:
    """One ``AFD_*`` variable: name, default (when unset), parser and meaning."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    help: str


_REGISTRY: dict[str, EnvVar] = {}


def register(name: str, default: Any, help: str, parse: Callable[[str], Any] = str) -> EnvVar:
    """Declare a variable (module import time). Names must start with ``AFD_`` and be unique.

    Raises:
        AFDConfigError: the name does not start with ``AFD_``, or is declared twice.
    """
    if not name.startswith("AFD_"):
        raise AFDConfigError(f"environment variable {name!r} must start with AFD_")
    if name in _REGISTRY:
        raise AFDConfigError(f"environment variable {name} declared twice")
    var = EnvVar(name, default, parse, help)
    _REGISTRY[name] = var
    return var


def get(name: str) -> Any:
    """The parsed value of a declared variable, or its default when unset.

    Raises:
        AFDConfigError: ``name`` was never declared here (was a ``KeyError``), or the
            value does not parse; the message names the variable.
    """
    try:
        var = _REGISTRY[name]
    except KeyError:
        raise AFDConfigError(f"{name} is not declared in afd_ext.envs; add a register() entry") from None
    raw = os.environ.get(name)
    if raw is None:
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise AFDConfigError(f"environment variable {name}={raw!r}: {e}") from None


def describe() -> list[dict]:
    """Every declared variable: ``[{"name", "default", "value", "help"}]`` (value = raw string or None)."""
    return [
        {"name": v.name, "default": v.default, "value": os.environ.get(v.name), "help": v.help}
        for v in _REGISTRY.values()
    ]


# --- build time (read by setup.py itself) -----------------------------------
register(
    "AFD_USE_CUDA",
    None,
    "build time: 1 requires a CUDA build of afd_ext._C, 0 forces a CPU-only build; "
    "unset: CUDA when torch is a CUDA build and a toolkit is found (CUDA_HOME or /usr/local/cuda)",
    parse_bool,
)


# --- process launch (set by `afd-ext launch` or you, read by afd_ext.tools.launch.config_from_env) ---
def _non_negative_int(value: str) -> int:
    v = int(value)
    if v < 0:
        raise AFDConfigError(f"expected an int >= 0, got {v}")
    return v


register("AFD_ROLE", None, "launch: this process's role, 'attention' or 'ffn' (default: from torchrun's RANK)")
register("AFD_ROLE_RANK", None, "launch: this process's rank inside its role (0-based)", _non_negative_int)
register("AFD_NUM_ATTENTION_RANKS", None, "launch: number of attention ranks A", _non_negative_int)
register("AFD_NUM_FFN_RANKS", None, "launch: number of FFN ranks F", _non_negative_int)
register("AFD_ROLES", None,
         "launch: the role of each torchrun rank in order, e.g. 'ffn,attention,attention' "
         "(default: FFN ranks first)")
register("AFD_HOST", None, "launch: rendezvous host, FFN rank 0's address (default: torchrun's MASTER_ADDR)")
register("AFD_PORT", None, "launch: rendezvous port on AFD_HOST (default: the config's, 1239)", _non_negative_int)
register("AFD_DEVICE", None, "launch: CUDA device index to use inside this process "
         "(default: from AFD_ATTENTION_GPUS / AFD_FFN_GPUS, else torchrun's LOCAL_RANK)", _non_negative_int)
register("AFD_ATTENTION_GPUS", None, "launch: GPU per attention rank, e.g. '0,0' (one entry: shared by all)")
register("AFD_FFN_GPUS", None, "launch: GPU per FFN rank, e.g. '1' (one entry: shared by all)")
register("AFD_JOB_ID", None,
         "rendezvous: identity of this AFD job (same on every rank); the store refuses a rank of another "
         "job. Overrides torchrun's TORCHELASTIC_RUN_ID; connector_extra_config.job_id overrides both")
def json_object(value: str) -> dict:
    """A JSON object's text as a dict (blank: ``{}``).

    Raises:
        ValueError: not JSON; AFDConfigError (a ValueError): JSON but not an object.
    """
    out = json.loads(value) if value.strip() else {}
    if not isinstance(out, dict):
        raise AFDConfigError(f"expected a JSON object, got {value!r}")
    return out


register("AFD_CONNECTOR_EXTRA_CONFIG", None,
         "launch: JSON object merged into connector_extra_config by config_from_env", json_object)

# --- control plane (afd_ext.control) -------------------------------------------
register("AFD_CONTROL_ADDR", None,
         "control plane: address an FFN rank listens on and advertises for its TCP control channel "
         "(default: the local address that routes to the rendezvous host)")
def _non_negative_float(value: str) -> float:
    v = float(value)
    if not v >= 0:
        raise AFDConfigError(f"expected a number >= 0, got {value!r}")
    return v


register("AFD_CONTROL_IDLE_S", 10.0,
         "control plane: seconds after the last payload that a waiting FFN rank keeps polling "
         "(native code, GIL released: one core per FFN rank while serving) before it sleeps and "
         "wakes ~100 us slower; 0 always sleeps (machines with fewer cores than ranks)",
         _non_negative_float)
#: Control-plane variables whose machinery is gone: accepted, ignored with a DeprecationWarning.
REMOVED_CONTROL = ("AFD_CONTROL_WARM_S", "AFD_CONTROL_KEEP_S", "AFD_CONTROL_KEEP_CPUS", "AFD_CONTROL_TCP_PROXY")
for _name in REMOVED_CONTROL:
    register(_name, None, "control plane: deprecated and ignored (it tuned the cache keepers removed in "
             "issue 33); a value set warns once at init", lambda value: None)

# --- vLLM + afd-plugin integration (afd_ext.integrations.afd_plugin) ---------------------
register("AFD_EXT_REPLACE_P2P", False,
         "afd-plugin integration: 1 registers afd_ext under the reference's connector name "
         "'P2pNcclAFDConnector' (replacing the reference's NCCL connector) when vLLM loads its plugins, "
         "so the reference's runners build afd_ext; set it in every attention and FFN process", parse_bool)

# --- tests and the bench --------------------------------------------------------------------
register("AFD_TEST_SHARE_GPU", False,
         "tests and bench: 1 forces the shared-GPU arrangement (every process on GPU 0 with its own "
         "NCCL_HOSTID, NCCL over sockets; correctness only) on a machine with several GPUs, to rehearse "
         "a one-GPU run (afd_ext.tools.testing.place_processes)", parse_bool)
register("AFD_PEER_STRUCTURE_ONE_GPU", False,
         "bench --peer-structure: 1 keeps both roles on cuda:0 where two GPUs are visible (the one-GPU "
         "records; scripts/gpu_tier.sh)", parse_bool)

# --- peer-memory plane (csrc/cuda/peer_kernels.cu reads it at each launch) ------------------
register("AFD_PEER_PDL", None,
         "peer-memory plane: 1 / 0 forces programmatic dependent launch of peer_put/peer_wait (their "
         "launch overlaps the end of the kernel before them on the stream) on or off; unset, it is used "
         "on Hopper+ for grids of at most half the SMs; read at each launch, so at capture time for a "
         "CUDA graph; docs/peer-memory.md", parse_bool)
