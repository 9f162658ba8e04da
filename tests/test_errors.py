"""``afd_ext.errors`` re-exports every documented exception class."""

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
    named -= {"ValueError", "TypeError", "RuntimeError", "TimeoutError", "FileNotFoundError"}
    assert named, "the troubleshooting table names no error classes"
    missing = sorted(n for n in named if n not in errors.__all__)
    assert not missing, f"documented but not importable from afd_ext.errors: {missing}"


# ---------------------------------------------------------------- every deliberate raise is an AFDError

import ast  # noqa: E402
import builtins  # noqa: E402
import importlib  # noqa: E402
import pkgutil  # noqa: E402

import afd_ext  # noqa: E402

#: Modules whose deliberate raises are all AFDError leaves (the connector, the transports and the
#: modules they rest on). TypeError stays a TypeError: a wrong Python type is a programming error.
_STRICT_MODULES = (
    "afd_ext.connector", "afd_ext.connector.sequencer", "afd_ext.connector.step", "afd_ext.connector.buffers",
    "afd_ext.connector.attention", "afd_ext.connector.ffn", "afd_ext.connector.session",
    "afd_ext.transport", "afd_ext.transport.base", "afd_ext.transport.strict", "afd_ext.transport.gloo",
    "afd_ext.transport.nccl", "afd_ext.transport.signal", "afd_ext.transport.stall",
    "afd_ext.spec", "afd_ext.watchdog",
)
_ALLOWED_BUILTINS = (TypeError, NotImplementedError)


def _modules():
    out = []
    for info in pkgutil.walk_packages(afd_ext.__path__, "afd_ext."):
        try:
            out.append(importlib.import_module(info.name))
        except ImportError:  # an optional extra (demo/bench plots) not installed here
            continue
    return out


def _raised_classes(mod):
    """``(line, class)`` of every ``raise X(...)`` / ``raise X`` in ``mod`` whose X resolves to a class."""
    path = getattr(mod, "__file__", None)
    if not path or not path.endswith(".py"):
        return []
    tree = ast.parse(Path(path).read_text())
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        obj = None
        if isinstance(exc, ast.Name):
            obj = vars(mod).get(exc.id, getattr(builtins, exc.id, None))
        elif isinstance(exc, ast.Attribute) and isinstance(exc.value, ast.Name):
            obj = getattr(vars(mod).get(exc.value.id), exc.attr, None)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            found.append((node.lineno, obj))
    return found


#: Not the library's runtime: the multi-process test harness (its WorkerError carries a worker's traceback).
_HARNESS = ("afd_ext.testing",)


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
        for line, cls in _raised_classes(m):
            if cls.__module__ != "builtins" and cls.__module__.startswith("afd_ext") and \
                    not cls.__name__.startswith("_") and not issubclass(cls, errors.AFDError):
                bad.append(f"{m.__name__}:{line} raises {cls.__name__}")
    assert not bad, bad


def test_the_connector_and_transports_raise_only_afd_errors():
    bad = []
    for name in _STRICT_MODULES:
        m = importlib.import_module(name)
        raised = _raised_classes(m)
        for line, cls in raised:
            if not issubclass(cls, errors.AFDError) and not issubclass(cls, _ALLOWED_BUILTINS):
                bad.append(f"{name}:{line} raises {cls.__name__}")
    assert not bad, bad


def test_the_walk_sees_raises():
    """The check above can fail: it resolves the raises of a module known to raise AFD leaves."""
    import afd_ext.connector.sequencer as seq

    classes = {cls for _, cls in _raised_classes(seq)}
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
