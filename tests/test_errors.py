"""``afd_ext.errors`` re-exports every documented exception class."""

import re
from pathlib import Path

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
