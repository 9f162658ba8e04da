"""afd-plugin's own unit tests with afd_ext as its connector, against the exact list of expected differences.

Runs ``tests/unit`` of the afd-plugin source tree (``AFD_PLUGIN_SRC``, set by ``make test-vllm``)
twice: as shipped (the reference), and with afd_ext replacing ``P2pNcclAFDConnector``
(``VLLM_PLUGINS=afd_ext``, ``AFD_EXT_REPLACE_P2P=1``, ``-p afd_ext_as_connector``). Every test
that passes with the reference must pass with afd_ext, except those listed in :data:`EXPECTED`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("vllm.config", reason="the vLLM integration suite runs in make test-vllm's environment")
pytest.importorskip("afd_plugin.v1.worker.ffn_worker", reason="needs afd-plugin (make test-vllm)")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

_P2P = "tests.unit.connectors.test_p2p_connector::"
_PRIVATE = "reads the reference connector's private state ({}), which afd_ext does not have"
_UNINIT = ("calls update_state_from_dp_metadata on a connector never initialised; afd_ext refuses that "
           "(AFDStateError) instead of building the step without its peers")

#: Tests that pass with the reference connector and not with afd_ext, each with its reason.
EXPECTED = {
    _P2P + "test_p2p_connector_is_registered": "asserts the class name 'P2pNcclAFDConnector' (ours: AfdExtAFDConnector)",
    _P2P + "test_p2p_connector_can_be_constructed_without_runtime_initialization": _PRIVATE.format("world_rank"),
    _P2P + "test_p2p_connector_uses_factory_resolved_role_rank": _PRIVATE.format("mapping"),
    _P2P + "test_p2p_hidden_state_send_uses_registered_custom_op": _PRIVATE.format("_send_hidden_states"),
    _P2P + "test_p2p_recv_preserves_dynamic_ref_tensor_first_dim": _PRIVATE.format("_recv_hidden_states"),
    _P2P + "test_p2p_recv_single_rank_requires_ref_tensor": _PRIVATE.format("_recv_hidden_states"),
    _P2P + "test_p2p_tensor_metadata_clamps_idle_attention_rank_to_dummy_token": _UNINIT,
    **{_P2P + f"test_p2p_ffn_metadata_tracks_each_attention_peer_in_xayf[{case}]": _UNINIT for case in (
        "2-1-0-token_counts0-expected_peer_tokens0", "4-2-0-token_counts1-expected_peer_tokens1",
        "4-2-1-token_counts2-expected_peer_tokens2", "6-3-2-token_counts3-expected_peer_tokens3")},
}


def _run(src: Path, xml: Path, env: dict[str, str], *extra: str) -> dict[str, str]:
    """Run afd-plugin's unit tests; ``{test id: passed/failure/error/skipped}``."""
    out = subprocess.run([sys.executable, "-m", "pytest", "tests/unit", "-q", "-p", "no:cacheprovider",
                          f"--junitxml={xml}", *extra], cwd=src, env=env, capture_output=True, text=True,
                         timeout=800)
    assert xml.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    res = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        states = [c.tag for c in tc if c.tag in ("failure", "error", "skipped")]
        res[f"{tc.attrib['classname']}::{tc.attrib['name']}"] = states[0] if states else "passed"
    return res


def test_afd_plugin_unit_tests_with_afd_ext_as_connector(tmp_path):
    src = os.environ.get("AFD_PLUGIN_SRC")
    if not src or not (Path(src) / "tests" / "unit").is_dir():
        pytest.skip("AFD_PLUGIN_SRC (an afd-plugin source tree with tests/unit) is not set; make test-vllm sets it")
    base = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "AFD_EXT_REPLACE_P2P")}
    ref = _run(Path(src), tmp_path / "ref.xml", base)
    ours_env = {**base, "VLLM_PLUGINS": "afd_ext", "AFD_EXT_REPLACE_P2P": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), base.get("PYTHONPATH")]))}
    ours = _run(Path(src), tmp_path / "ours.xml", ours_env, "-p", "afd_ext_as_connector")
    counts = (Counter(ref.values()), Counter(ours.values()))
    print(f"afd-plugin unit tests: reference {dict(counts[0])}, afd_ext {dict(counts[1])}")
    assert set(ref) == set(ours), "the two runs collected different tests"
    assert counts[0]["failure"] == counts[0]["error"] == 0, f"the reference itself fails: {counts[0]}"
    changed = {t for t in ref if ref[t] != ours[t]}
    assert changed == set(EXPECTED), (f"unexpected: {sorted(changed - set(EXPECTED))}; "
                                      f"expected but unchanged: {sorted(set(EXPECTED) - changed)}")
    assert all(ref[t] == "passed" and ours[t] == "failure" for t in EXPECTED)
