"""``afd_ext.errors`` re-exports every documented exception class."""

import builtins
import re
from pathlib import Path

import pytest

import afd_ext.errors as errors


def test_every_exported_name_is_an_exception():
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), Exception), name


def test_every_error_class_in_troubleshooting_is_exported():
    text = (Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md").read_text()
    named = set(re.findall(r"`([A-Z][A-Za-z]+(?:Error|Closed|Timeout))\b", text))
    named -= {n for n in vars(builtins) if n.endswith("Error")}  # the built-ins the docs name beside ours
    assert named, "the troubleshooting table names no error classes"
    missing = sorted(n for n in named if n not in errors.__all__)
    assert not missing, f"documented but not importable from afd_ext.errors: {missing}"


# ---------------------------------------------------------------- every deliberate raise is an AFDError

import argparse  # noqa: E402
import ast  # noqa: E402
import importlib  # noqa: E402
import pkgutil  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import afd_ext  # noqa: E402

#: Builtins a deliberate raise may still use, each for callers that rely on the builtin itself:
#: TypeError (a wrong Python type is a programming error), NotImplementedError (an abstract method,
#: a model class we cannot split), ImportError (a missing optional dependency: callers probe with
#: ``except ImportError``) and argparse.ArgumentTypeError (argparse turns it into the usage error).
_ALLOWED_BUILTINS = (TypeError, NotImplementedError, ImportError, argparse.ArgumentTypeError)


def _modules():
    out = []
    for info in pkgutil.walk_packages(afd_ext.__path__, "afd_ext."):
        try:
            out.append(importlib.import_module(info.name))
        except ImportError:  # an optional extra (demo/bench plots) not installed here
            continue
    return out


def _raised_classes(mod):
    """``(line, class, function)`` of every ``raise X(...)`` / ``raise X`` in ``mod`` whose X resolves to a class.

    ``function`` is the name of the innermost enclosing ``def`` (None at module level). A raise of an
    instance made elsewhere (``raise exc``) does not resolve and is not listed.
    """
    path = getattr(mod, "__file__", None)
    if not path or not path.endswith(".py"):
        return []
    tree = ast.parse(Path(path).read_text())
    found = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                obj = None
                if isinstance(exc, ast.Name):
                    obj = vars(mod).get(exc.id, getattr(builtins, exc.id, None))
                elif isinstance(exc, ast.Attribute) and isinstance(exc.value, ast.Name):
                    obj = getattr(vars(mod).get(exc.value.id), exc.attr, None)
                if isinstance(obj, type) and issubclass(obj, BaseException):
                    found.append((child.lineno, obj, func))
            visit(child, func)

    visit(tree, None)
    return found


def _not_afd(mod):
    """``"module:line raises Class"`` for every raise in ``mod`` that breaks the rule."""
    bad = []
    for line, cls, func in _raised_classes(mod):
        if issubclass(cls, errors.AFDError) or issubclass(cls, _ALLOWED_BUILTINS):
            continue
        if cls is AttributeError and func == "__getattr__":  # a module __getattr__'s protocol (hasattr, import *)
            continue
        if cls is SystemExit and func == "_end_loop":  # ends afd-plugin's FFN loop thread on an orderly close (#32)
            continue
        bad.append(f"{mod.__name__}:{line} raises {cls.__name__}")
    return bad


#: Not the library's runtime: the multi-process test harness (its WorkerError carries a worker's traceback).
_HARNESS = ("afd_ext.tools.testing",)


def test_every_exception_class_defined_in_the_package_is_an_afd_error():
    """Public exception classes only: a private one (``launch._Stop``) is control flow that never escapes."""
    mods = _modules()
    assert any(m.__name__ == "afd_ext.connector" for m in mods) and len(mods) > 20
    bad = sorted({f"{m.__name__}.{n}" for m in mods if m.__name__ not in _HARNESS for n, o in vars(m).items()
                  if isinstance(o, type) and issubclass(o, BaseException) and o.__module__ == m.__name__
                  and not n.startswith("_") and not issubclass(o, errors.AFDError)})
    assert not bad, f"exception classes outside the AFDError tree: {bad}"


def test_every_package_exception_raised_is_an_afd_error():
    """A raise of a class that is not a builtin (defined in afd_ext) must be an AFDError."""
    bad = []
    for m in _modules():
        if m.__name__ in _HARNESS:
            continue
        for line, cls, _ in _raised_classes(m):
            if cls.__module__ != "builtins" and cls.__module__.startswith("afd_ext") and \
                    not cls.__name__.startswith("_") and not issubclass(cls, errors.AFDError):
                bad.append(f"{m.__name__}:{line} raises {cls.__name__}")
    assert not bad, bad


def test_every_deliberate_raise_is_an_afd_error():
    """Issue #12: every module but the harness raises AFDError leaves (or a builtin of _ALLOWED_BUILTINS)."""
    mods = [m for m in _modules() if m.__name__ not in _HARNESS]
    names = {m.__name__ for m in mods}
    # the walk reaches the leaves of the package, not only the connector
    assert {"afd_ext.metadata", "afd_ext.tools.demo", "afd_ext.tools.bench.variants", "afd_ext.control.tcp",
            "afd_ext.integrations.transformers", "afd_ext.integrations.afd_plugin"} <= names, names
    bad = [b for m in mods for b in _not_afd(m)]
    assert not bad, bad


def test_the_walk_sees_raises(tmp_path):
    """The check above can fail: it flags builtin raises in a module made for the purpose, and resolves
    the raises of a module known to raise AFD leaves."""
    src = tmp_path / "afd_walk_probe.py"
    src.write_text(
        "from afd_ext.errors import AFDConfigError\n"
        "def f(x):\n"
        "    if x == 1:\n        raise ValueError('v')\n"
        "    if x == 2:\n        raise KeyError(x)\n"
        "    if x == 3:\n        raise AttributeError('a')\n"
        "    if x == 4:\n        raise AFDConfigError('c')\n"
        "    if x == 5:\n        raise TypeError('t')\n"
        "    def inner():\n        raise RuntimeError('r')\n"
        "    return inner\n"
        "def __getattr__(name):\n"
        "    raise AttributeError(name)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        probe = importlib.import_module("afd_walk_probe")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("afd_walk_probe", None)
    assert isinstance(probe, types.ModuleType)
    assert _not_afd(probe) == ["afd_walk_probe:4 raises ValueError", "afd_walk_probe:6 raises KeyError",
                               "afd_walk_probe:8 raises AttributeError", "afd_walk_probe:14 raises RuntimeError"]
    import afd_ext.connector.sequencer as seq

    classes = {cls for _, cls, _ in _raised_classes(seq)}
    assert errors.AFDStateError in classes and len(classes) >= 2


def test_step_aborted_says_how_to_recover_once():
    plain = errors.StepAbortedError("send_attn_output layer 3 failed.", "attention rank 0", op="barrier")
    assert str(plain).startswith("AFD step aborted by attention rank 0 while barrier: send_attn_output layer 3 "
                                 "failed. The connector must be closed")
    assert str(plain).count("init_afd_connector") == 1
    # the aborting rank's reason already carries the instruction (the connector's mid-step note)
    told = errors.StepAbortedError("bad shape. The step was already under way on FFN rank 0, so it was aborted "
                                   "on every rank; close() and init_afd_connector() to continue.", "FFN rank 0")
    assert str(told).count("init_afd_connector") == 1 and str(told).endswith("to continue.")


def test_a_broken_connector_says_how_to_recover_once():
    from afd_ext.connector.session import Session

    s = Session("attention rank 0 (world rank 1)", "attention", False, None)
    s.initialized, s.transport = True, object()
    s.broken = errors.StepAbortedError("send_attn_output layer 3 failed.", "FFN rank 0", op="recv")
    with pytest.raises(errors.AFDStateError) as e:
        s.check_usable("send_attn_output")
    assert str(e.value).count("init_afd_connector") == 1 and "FFN rank 0" in str(e.value)
    s.broken = errors.AFDPeerError("FFN rank 0 closed its end")
    with pytest.raises(errors.AFDStateError) as e:
        s.check_usable("send_attn_output")
    msg = str(e.value)
    assert msg.count("init_afd_connector") == 1 and msg.endswith("before send_attn_output"), msg


# ---------------------------------------------------------------- the ops boundary: every op failure is an AFDError


def _op_cases():
    import torch

    from afd_ext import ops

    h, ids = torch.zeros(2, 4), torch.zeros(2)
    u8 = torch.zeros(3, dtype=torch.uint8)
    return [  # (call, builtin the failure was before the boundary and still is)
        (lambda: ops.send(h, 1, 0), ValueError),
        (lambda: ops.recv(h, "one", 0), ValueError),  # int("one")
        (lambda: ops.fan_in([h, ids], [1], [0], [2]), ValueError),
        (lambda: ops.split_back([h], None, [0], [2]), TypeError),  # a list is required
        (lambda: ops.comm_destroy(None), TypeError),
        (lambda: ops.comm_create(u8, 2, 0, 0), ValueError),
        (lambda: ops.nccl_unique_id(u8), ValueError),
        (lambda: ops.peer_region_close(10**6), ValueError),
        (lambda: ops.peer_region_open(1, b"\0" * 3, 64), ValueError),
    ]


@pytest.mark.parametrize("case", range(9))
def test_a_bad_argument_of_an_op_is_an_afd_error_that_keeps_its_builtin(case):
    call, builtin = _op_cases()[case]
    with pytest.raises(afd_ext.AFDError) as info:
        call()
    assert isinstance(info.value, errors.AFDConfigError) and isinstance(info.value, builtin), type(info.value)
    assert isinstance(info.value, RuntimeError)  # callers that caught the C++ RuntimeError still do
    assert str(info.value).startswith("afd_ext.") and info.value.op.startswith("afd_ext.")


def test_op_error_maps_each_native_failure_kind_to_its_leaf():
    import torch

    from afd_ext.ops import op_error

    nccl = op_error("send", torch.distributed.DistBackendError("afd_ext: NCCL error 6 (remote process exited)"))
    assert type(nccl) is errors.AFDPeerError and nccl.op == "afd_ext.send"
    cuda = op_error("peer_put", RuntimeError("afd_ext: CUDA error 700 (an illegal memory access)"))
    assert type(cuda) is errors.AFDDeviceError
    dtype = op_error("fan_in", TypeError("afd_ext.fan_in: token_ids must be int32"))
    assert type(dtype) is errors.AFDTypeError and isinstance(dtype, TypeError) and isinstance(dtype, ValueError)
    check = op_error("peer_wait", RuntimeError("afd_ext.peer_wait: plane 3 is not live"))
    assert type(check) is errors.AFDConfigError and str(check) == "afd_ext.peer_wait: plane 3 is not live"
    # The stable-ABI core raises std exceptions only: the class rides at the head of the message.
    stable_dtype = op_error("fan_in", ValueError("TypeError: afd_ext.fan_in: tensors[0] has dtype Bool"))
    assert type(stable_dtype) is errors.AFDTypeError and str(stable_dtype) == "afd_ext.fan_in: tensors[0] has dtype Bool"
    stable_nccl = op_error("send", RuntimeError("DistBackendError: afd_ext: NCCL error 6 (remote process exited)"))
    assert type(stable_nccl) is errors.AFDPeerError and str(stable_nccl).startswith("afd_ext: NCCL error 6")
    same = errors.AFDStateError("x")
    assert op_error("send", same) is same
