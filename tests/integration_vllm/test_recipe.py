"""docs/vllm.md's recipe against the installed vLLM and afd-plugin: the commands parse with that vLLM's
parser, ``afd-ext info`` says which connector afd-plugin's factory resolves, and the router-logit dtype
rule is vLLM's. (The warning on an untested vLLM is tested in the CPU tier, test_afd_plugin_dropin.py.)"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.config", reason="the vLLM integration suite runs in make test-vllm's environment")
pytest.importorskip("afd_plugin.v1.worker.ffn_worker", reason="needs afd-plugin (make test-vllm)")

from afd_ext.integrations.afd_plugin import TESTED_VLLM_VERSIONS, versions  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.every_vllm]

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def _serve_commands() -> list[list[str]]:
    """Every ``vllm serve`` line of the doc's bash blocks, split as a shell would (env assignments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    out = []
    for line in (ln for b in blocks for ln in b.splitlines()):
        if " vllm serve " in f" {line} ":
            argv = shlex.split(line)
            out.append(argv[argv.index("vllm") + 2:])
    return out


def _serve_arg_parser():
    """``vllm serve``'s ``make_arg_parser``, wherever this vLLM keeps it."""
    for module in ("vllm.entrypoints.openai.cli_args",  # 0.26
                   "vllm.entrypoints.launchers.cli_args",  # 0.30
                   "vllm.entrypoints.common.cli_args"):  # 0.33
        try:
            return importlib.import_module(module).make_arg_parser
        except ModuleNotFoundError as e:
            if e.name != module:  # the module is there but an import inside it failed
                raise
    raise AssertionError("this vLLM has make_arg_parser in none of the known modules")


def test_docs_serve_commands_parse_with_vllms_own_parser(monkeypatch):
    from afd_plugin.config import parse_afd_config
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # No GPU here: the parser's defaults build a DeviceConfig, which needs a device type.
    monkeypatch.setattr(current_platform, "device_type", "cpu", raising=False)
    make_arg_parser = _serve_arg_parser()

    cmds = _serve_commands()
    assert len(cmds) == 2, cmds
    roles = {}
    for argv in cmds:
        parser = FlexibleArgumentParser()
        parser.add_argument("model_tag", nargs="?")  # as `vllm serve` adds it
        ns = make_arg_parser(parser).parse_args(argv)
        afd = ns.additional_config["afd"]
        cfg = parse_afd_config(types.SimpleNamespace(additional_config=ns.additional_config),
                               expected_role=afd["role"])
        roles[cfg.role] = (ns.model_tag, cfg.connector, cfg.host, cfg.port, cfg.num_attention_ranks,
                           cfg.num_ffn_ranks, cfg.compute_gate_on_attention, afd["connector_extra_config"])
    assert sorted(roles) == ["attention", "ffn"]
    assert roles["attention"] == roles["ffn"], roles  # both roles must agree on everything but the role
    assert roles["ffn"][1] == "P2pNcclAFDConnector"


@pytest.mark.parametrize("replace", [True, False])
def test_afd_ext_info_says_what_afd_plugins_factory_resolves(replace):
    env = {k: v for k, v in os.environ.items() if k not in ("AFD_EXT_REPLACE_P2P", "VLLM_PLUGINS")}
    if replace:
        env["AFD_EXT_REPLACE_P2P"] = "1"
    out = subprocess.run([sys.executable, "-m", "afd_ext", "info"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(re.split(r"\s{2,}", ln, maxsplit=1) for ln in out.stdout.splitlines() if re.search(r"\s{2,}", ln))
    vllm = versions()["vllm"]
    assert vllm in TESTED_VLLM_VERSIONS, vllm  # this environment runs a version the warning calls tested
    assert lines["vLLM"].startswith(f"{vllm} (tested: {', '.join(TESTED_VLLM_VERSIONS)}); afd-plugin "), lines
    p2p = lines["afd-plugin P2pNcclAFDConnector"]
    if replace:
        assert p2p == "afd_ext (afd_ext.integrations.afd_plugin.AfdExtAFDConnector)", p2p
    else:
        assert p2p == "NOT afd_ext (afd_plugin.connectors.gpu.p2p.P2pNcclAFDConnector)", p2p
    assert lines["afd-plugin AfdExtConnector"] == "afd_ext (afd_ext.integrations.afd_plugin.AfdExtAFDConnector)"


@pytest.mark.parametrize("model_type, router", [("deepseek_v3", None), ("deepseek_v3", "float32"),
                                                ("deepseek_v3", "bfloat16"), ("deepseek_v2", "float32"),
                                                ("glm_moe_dsa", None), ("glm_moe_dsa", "bfloat16")])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_router_logits_dtype_is_what_vllms_gate_emits(model_type, router, model_dtype):
    from vllm.model_executor.models import deepseek_v2 as native

    from afd_ext.spec import router_logits_dtype

    hf = types.SimpleNamespace(model_type=model_type, moe_router_dtype=router)
    gate = native._get_moe_router_dtype(hf) or model_dtype  # GateLinear: out_dtype, else its weight's dtype
    assert router_logits_dtype(types.SimpleNamespace(hf_config=hf, hf_text_config=hf), model_dtype) == gate
