"""The vLLM integration suite (``make test-vllm``): skipped where vLLM or afd-plugin is not installed.

The whole suite runs on ``vllm_workers.FULL_SUITE_VLLM`` (afd-plugin 2e4378f's vLLM); on any other
tested vLLM only the tests marked ``every_vllm`` run, the others are skipped saying so (docs/vllm.md).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from vllm_workers import FULL_SUITE_VLLM


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM and afd-plugin installed (make test-vllm)")
    config.addinivalue_line("markers", f"every_vllm: runs on every tested vLLM, not only {FULL_SUITE_VLLM}")


def pytest_collection_modifyitems(config, items):
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return
    if version == FULL_SUITE_VLLM:
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason=f"runs on vLLM {FULL_SUITE_VLLM} only (this is {version}; docs/vllm.md)")
    for item in items:  # this hook sees every collected item, not only this directory's
        if here in Path(item.fspath).parents and "every_vllm" not in item.keywords:
            item.add_marker(skip)
