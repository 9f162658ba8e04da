"""AFDConfig: reference fields, aliases, coercion and errors; our connector's extra config (pure)."""

from __future__ import annotations

import json

import pytest

from afd_ext.errors import AFDTypeError
from afd_ext.config import (
    DEFAULT_CONNECTOR,
    REFERENCE_CONNECTOR,
    AFDConfig,
    AfdExtConnectorConfig,
    coerce_bool,
    coerce_int,
    has_afd_config,
    parse_afd_config,
    parse_optional_afd_config,
)


def test_defaults():
    c = AFDConfig()
    assert c.connector == DEFAULT_CONNECTOR
    assert (c.role, c.port, c.host, c.num_attention_ranks, c.num_ffn_ranks) == ("attention", 1239, "127.0.0.1", 1, 1)
    assert not c.async_dp and not c.compute_gate_on_attention
    assert c.extra == AfdExtConnectorConfig()
    assert c.is_attention_server and not c.is_ffn_server


def test_aliases_and_properties():
    c = AFDConfig.from_dict({
        "afd_connector": REFERENCE_CONNECTOR, "afd_role": "ffn", "afd_host": "10.0.0.2",
        "afd_port": 4000, "num_attention_ranks": 4, "num_ffn_ranks": 2, "async": False,
        "compute_gate_on_attention": "yes",
    })
    assert (c.afd_connector, c.afd_role, c.afd_host, c.afd_port) == (REFERENCE_CONNECTOR, "ffn", "10.0.0.2", 4000)
    assert c.is_ffn_server and c.compute_gate_on_attention is True
    assert c.extra is not None  # the reference name maps to our connector
    assert AFDConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize(
    "raw, exc, match",
    [
        ({"role": "ffn", "afd_role": "ffn"}, ValueError, "duplicate AFD config field 'role'"),
        ({"port": 1, "afd_port": 2}, ValueError, "duplicate"),
        ({"async": True, "async_dp": True}, ValueError, "duplicate"),
        ({"wire_format": "packed"}, ValueError, "unknown AFD config field 'wire_format'.*connector_extra_config"),
        ({"role": "expert"}, ValueError, "unknown AFD role"),
        ({"port": 0}, ValueError, "port"),
        ({"port": 65536}, ValueError, "port"),
        ({"port": True}, TypeError, "port must be an int"),
        ({"port": 12.0}, TypeError, "port must be an int"),
        ({"port": "abc"}, TypeError, "port must be an int"),
        ({"num_attention_ranks": 0}, ValueError, "num_attention_ranks must be positive"),
        ({"num_ffn_ranks": -1}, ValueError, "num_ffn_ranks must be positive"),
        ({"host": ""}, ValueError, "host"),
        ({"connector": ""}, ValueError, "connector"),
        ({"compute_gate_on_attention": "maybe"}, TypeError, "compute_gate_on_attention must be a bool"),
        ({"async": 2}, TypeError, "async_dp must be a bool"),
        ({"async": True}, ValueError, "async_dp=True requires an asynchronous connector"),
        ({"connector_extra_config": [1]}, TypeError, "connector_extra_config must be a mapping"),
        ({"connector_extra_config": {"bogus": 1}}, ValueError, "unknown connector_extra_config field"),
        ({"connector_extra_config": {"transport": "mpi"}}, ValueError, "transport"),
        ({"connector_extra_config": {"control_channel": "udp"}}, ValueError, "control_channel"),
        ({"connector_extra_config": {"step_timeout_s": 0}}, ValueError, "step_timeout_s must be > 0"),
        ({"connector_extra_config": {"init_timeout_s": float("inf")}}, ValueError, "finite"),
        ({"connector_extra_config": {"init_timeout_s": True}}, TypeError, "number"),
        ({"connector_extra_config": {"max_stages": 0}}, ValueError, "max_stages"),
        ({"connector_extra_config": {"strict": "sometimes"}}, TypeError, "strict"),
        ({"connector_extra_config": {"heartbeat_interval_s": 5, "heartbeat_timeout_s": 5}}, ValueError,
         "heartbeat_timeout_s"),
    ],
)
def test_errors(raw, exc, match):
    with pytest.raises(exc, match=match):
        AFDConfig.from_dict(raw)


def test_not_a_mapping():
    with pytest.raises(AFDTypeError):
        AFDConfig.from_dict([("role", "ffn")])  # type: ignore[arg-type]


def test_expected_role():
    assert AFDConfig.from_dict({"role": "ffn"}, expected_role="ffn").role == "ffn"
    with pytest.raises(ValueError, match="'attention' role"):
        AFDConfig.from_dict({"role": "ffn"}, expected_role="attention")


def test_coercion_rules():
    for v in (True, 1, "1", "true", "YES", "on", " On "):
        assert coerce_bool(v, "x") is True
    for v in (False, 0, "0", "false", "no", "off"):
        assert coerce_bool(v, "x") is False
    for v in (2, "", "y", None, 1.0):
        with pytest.raises(AFDTypeError):
            coerce_bool(v, "x")
    assert coerce_int(5, "x") == 5 and coerce_int("42", "x") == 42
    for v in (True, 1.0, "4.0", None, "٣"):
        with pytest.raises(AFDTypeError):
            coerce_int(v, "x")


def test_extra_config_parsing_and_round_trip():
    raw = {"strict": "true", "clamp_idle_to_one": 1,
           "init_timeout_s": 900, "step_timeout_s": "12.5", "transport": "gloo", "control_channel": "tcp",
           "max_stages": 2, "graph_cache_size": 0}
    c = AFDConfig.from_dict({"connector_extra_config": raw})
    e = c.extra
    assert (e.strict, e.clamp_idle_to_one) == (True, True)
    assert (e.init_timeout_s, e.step_timeout_s, e.transport, e.control_channel) == (900.0, 12.5, "gloo", "tcp")
    assert AfdExtConnectorConfig.from_mapping(e.to_mapping()) == e
    assert c.extra_config() is e
    assert AfdExtConnectorConfig.from_mapping(None) == AfdExtConnectorConfig()
    with pytest.raises(AFDTypeError):
        AfdExtConnectorConfig.from_mapping([1])  # type: ignore[arg-type]


def test_third_party_connector_extra_config_untouched():
    c = AFDConfig.from_dict({"connector": "MyConnector", "async": True, "connector_extra_config": {"foo": 1}})
    assert c.extra is None and c.connector_extra_config == {"foo": 1} and c.async_dp
    with pytest.raises(ValueError, match="unknown connector_extra_config"):
        c.extra_config()


def test_json_and_additional_config():
    text = json.dumps({"afd": {"afd_role": "ffn", "num_attention_ranks": 2}})
    assert AFDConfig.from_json(text).num_attention_ranks == 2
    assert AFDConfig.from_json(json.dumps({"role": "ffn"})).role == "ffn"
    with pytest.raises(ValueError, match="JSON"):
        AFDConfig.from_json("{")
    assert has_afd_config({"afd": {}}) and not has_afd_config({}) and not has_afd_config(None)
    assert parse_afd_config({"afd": {"role": "ffn"}}).is_ffn_server
    assert parse_optional_afd_config({"other": 1}) is None
    with pytest.raises(ValueError, match="no \"afd\" section"):
        parse_afd_config({})


def test_hash_and_compute_hash():
    a = AFDConfig.from_dict({"num_attention_ranks": 2})
    b = AFDConfig.from_dict({"num_attention_ranks": "2"})
    assert a == b and hash(a) == hash(b) and a.compute_hash() == b.compute_hash()
    assert a.compute_hash() != AFDConfig().compute_hash()
    # the extra config does not enter the reference hash, but does enter equality
    c = AFDConfig.from_dict({"num_attention_ranks": 2, "connector_extra_config": {"strict": True}})
    assert c.compute_hash() == a.compute_hash() and c != a


def test_an_old_config_naming_the_removed_wire_format_warns_and_still_parses():
    raw = {"wire_format": "packed", "packed_max_bytes": 4096, "strict": True}
    with pytest.warns(DeprecationWarning, match=r"wire_format.*packed_max_bytes.*deprecated and ignored"):
        c = AFDConfig.from_dict({"connector_extra_config": raw})
    assert c.extra.strict is True and c.extra == AfdExtConnectorConfig(strict=True)
    assert "wire_format" not in c.extra.to_mapping()
