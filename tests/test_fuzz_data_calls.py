"""Fuzz of the four data calls' arguments (issue 34), in the CPU tier over gloo, with a fixed seed.

One attention rank and one FFN rank run one step per case (two stages, one
layer, router logits and token ids configured, row counts 0..4). Each case
replaces one argument of one call at one stage by a variant of a category:
types, None, shapes, dtypes, devices, strides, layouts, indices (stage ids,
``layer_idx``), specs (``routing_spec``, ``recv_input_ids``) and contexts. The
variant is either accepted, and then what it carried is checked exactly (the
FFN compares every fan-in with the attention rank's inputs, the attention rank
every reply with ``ffn_fn`` of its rows), or refused with an ``AFDError`` whose
message names the argument, after which the rank makes the right call. Every
step, the ones after a refusal included, is checked exactly. The case list is
drawn by the test from :data:`SEED` and handed to both ranks.
"""

from __future__ import annotations

import collections
import math
import os
import random
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import connector_scenarios as cs  # noqa: E402
from afd_ext.tools.testing import find_free_port, run_workers  # noqa: E402

pytestmark = pytest.mark.timeout(240)

SEED = 20261203
CASES = int(os.environ.get("AFD_FUZZ_CASES", 6000))  # ~20 s of steps on a quiet 2-core box
HIDDEN, WIDTH = 8, 4

#: (call, argument) -> the categories fuzzed for it.
TARGETS = {
    ("send_attn_output", "hidden_states"): ("types", "none", "shapes", "dtypes", "devices", "strides", "layouts"),
    ("send_attn_output", "router_logits"): ("types", "none", "shapes", "dtypes", "devices", "strides", "layouts"),
    ("send_attn_output", "input_ids"): ("types", "none", "shapes", "dtypes", "devices", "strides", "layouts"),
    ("send_attn_output", "context"): ("contexts", "none", "indices"),
    ("recv_ffn_output", "ref_tensor"): ("types", "none", "shapes", "dtypes", "devices", "strides", "layouts"),
    ("recv_ffn_output", "ubatch_idx"): ("indices", "none"),
    ("recv_attn_output", "ubatch_idx"): ("indices", "none"),
    ("recv_attn_output", "routing_spec"): ("specs",),
    ("recv_attn_output", "recv_input_ids"): ("specs", "none"),
    ("send_ffn_output", "ffn_output"): ("types", "none", "shapes", "dtypes", "devices", "strides", "layouts"),
    ("send_ffn_output", "context"): ("contexts", "none"),
}

#: Words a refusal of the argument may name it by (the schedule calls input_ids the token ids; a context
#: whose row count disagrees with the tensor is named by either).
NAMES = {
    "input_ids": ("input_ids", "token_ids"),
    "context": ("context", "hidden_states", "ffn_output"),
}


def _cases() -> list[dict]:
    rng = random.Random(SEED)
    targets = sorted(TARGETS)
    out = []
    for i in range(CASES):
        call, arg = rng.choice(targets)
        out.append({"i": i, "call": call, "arg": arg, "cat": rng.choice(TARGETS[(call, arg)]),
                    "stage": rng.randrange(2), "v": rng.randrange(1 << 30), "rows": (rng.randrange(5), rng.randrange(5))})
    return out


# ------------------------------------------------------------------ variants (built in the workers)
def _tensor_variant(g, cat: str, v: int):
    import numpy as np
    import torch

    n = g.shape[0]
    if cat == "none":
        return None
    if cat == "types":
        return [g.tolist(), g.numpy(), 3, "x", (g,), 1.5, object(), np.float32(1.0)][v % 8]
    if cat == "shapes":
        more = torch.cat([g, g[:1] if n else g.new_zeros((1, *g.shape[1:]))])
        opts = [g[:-1] if n else more, more, g.unsqueeze(0), g.reshape(-1, 1), g[..., None],
                g.new_zeros((0, *g.shape[1:])) if n else more, g.new_tensor(1)]
        if g.dim() == 2:
            opts += [g[:, :-1], torch.cat([g, g[:, :1]], 1), g.reshape(-1)]
        return opts[v % len(opts)]
    if cat == "dtypes":
        dts = [torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8,
               torch.bool, torch.complex64, torch.float32]
        return g.to(dts[v % len(dts)])
    if cat == "devices":
        return [g.to("meta"), torch.empty_like(g, device="meta")][v % 2]
    if cat == "strides":
        opts = [torch.cat([torch.full_like(g[:1] if n else g.new_zeros((1, *g.shape[1:])), 99), g])[1:]]  # offset
        if g.dim() == 2:
            w = g.shape[1]
            opts += [torch.empty(w, n, dtype=g.dtype).t().copy_(g),  # column-major
                     torch.cat([g, torch.full_like(g, 99)], 1)[:, :w],  # columns of a wider tensor
                     torch.stack([g, torch.full_like(g, 99)], 1).reshape(2 * n, w)[::2],  # every other row
                     g[:1].expand(n, w) if n == 1 else g.as_strided(g.shape, (w, 1))]  # size-1 dims, any stride
            if n == 1:
                opts.append(g.as_strided(g.shape, (w * 5, 1)))
        else:
            opts += [torch.stack([g, torch.full_like(g, 99)], 1)[:, 0]]
        return opts[v % len(opts)]
    if cat == "layouts":
        opts = [g.to_sparse()]
        if g.dtype.is_floating_point:
            opts += [g.detach().clone().requires_grad_(), torch.nn.Parameter(g.clone())]
        return opts[v % len(opts)]
    raise ValueError(cat)


def _index_variant(good: int, other: int, v: int):
    import numpy as np
    import torch

    opts = [str(good), good + 0.5, math.nan, math.inf, -1, 2**40, True, [good], np.int64(good), float(good),
            torch.tensor(good), other, good + 2, np.float32(good), b"0", complex(good), np.float64(good) + 0.25]
    return opts[v % len(opts)]


def _spec_variant(arg: str, v: int):
    import torch

    from afd_ext.metadata import AFDExpertRoutingSpec

    RefSpec = collections.namedtuple("RefSpec", "router_logits_width router_logits_dtype")  # the reference's shape
    if arg == "routing_spec":
        opts = ["4", 4, (WIDTH, torch.float32), AFDExpertRoutingSpec(WIDTH, torch.float32),
                RefSpec(WIDTH, torch.float32), AFDExpertRoutingSpec(WIDTH + 1, torch.float32),
                AFDExpertRoutingSpec(WIDTH, torch.float16), AFDExpertRoutingSpec(str(WIDTH), torch.float32),
                AFDExpertRoutingSpec(WIDTH, "float32"), None, True]
    else:
        opts = [True, False, 1, 0, "yes", 2, 1.0, [True], "False"]
    return opts[v % len(opts)]


def _attention_context(cat: str, v: int, stage: int, other: int, n: int):
    from types import SimpleNamespace as NS

    from afd_ext.metadata import AFDTransferContext, AFDTransferMetadata

    if cat == "none":
        return [None, NS(metadata=None), AFDTransferContext(None)][v % 3]
    if cat == "indices":
        which = v % 2
        idx = _index_variant(stage if which == 0 else 0, other if which == 0 else 1, v // 2)
        fields = dict(layer_idx=0, stage_idx=stage, seq_lens=[n])
        fields["stage_idx" if which == 0 else "layer_idx"] = idx
        return NS(metadata=NS(**fields))
    opts = [object(), NS(metadata=NS(stage_idx=stage)), NS(metadata=NS(layer_idx=0, stage_idx=stage, seq_lens=[n])),
            AFDTransferContext(AFDTransferMetadata(0, stage, [n + 1])), NS(metadata=NS(layer_idx=0, stage_idx=stage,
                                                                                        seq_lens=[])),
            NS(metadata=NS(layer_idx=0, stage_idx=stage, seq_lens=[-1])), NS(metadata=NS(layer_idx=0, stage_idx=stage,
                                                                                         seq_lens=str(n))),
            AFDTransferContext(AFDTransferMetadata(0, stage, [n, 0])), "context",
            NS(metadata=NS(layer_idx=0, stage_idx=stage, seq_lens=[float(n)]))]
    return opts[v % len(opts)]


def _ffn_context(cat: str, v: int, ctx, prev_ctx, stage: int, other: int):
    from types import SimpleNamespace as NS

    from afd_ext.metadata import AFDTransferContext, AFDTransferMetadata

    md = ctx.metadata
    if cat == "none":
        return [None, NS(metadata=None), AFDTransferContext(None)][v % 3]
    opts = [object(), NS(metadata=md), AFDTransferContext(md),
            AFDTransferContext(AFDTransferMetadata(md.layer_idx, other, list(md.seq_lens))),
            AFDTransferContext(AFDTransferMetadata(md.layer_idx, stage, [sum(md.seq_lens) + 1])), "context",
            prev_ctx if prev_ctx is not None else object()]
    return opts[v % len(opts)]


# ------------------------------------------------------------------ the two ranks
def _try(out: dict, case: dict, fn, kwargs: dict):
    """Call ``fn`` with a fuzzed argument; record accepted / refused (named) / a failure. Returns (accepted, result)."""
    from afd_ext.errors import AFDError

    key = (case["call"], case["arg"], case["cat"])
    try:
        res = fn(**kwargs)
    except AFDError as e:
        names = NAMES.get(case["arg"], (case["arg"],))
        if any(n in str(e) for n in names):
            out["refused"][key] += 1
        else:
            out["failures"].append((case["i"], key, f"refused without naming {case['arg']}: {e}"[:400]))
        return False, None
    except Exception as e:  # noqa: BLE001 - a failure of the test, reported with the case
        out["failures"].append((case["i"], key, f"{type(e).__name__} (not an AFDError): {e}"[:400]))
        raise
    out["accepted"][key] += 1
    return True, res


def _fuzz_worker(rank, nprocs, sc, port, cases):
    import torch

    from afd_ext.metadata import AFDExpertRoutingSpec

    conn = cs.make_connector(sc, rank, port)
    conn.init_afd_connector()
    out = {"accepted": collections.Counter(), "refused": collections.Counter(), "failures": [], "steps": 0}
    spec = AFDExpertRoutingSpec(WIDTH, torch.float32)
    t0 = time.monotonic()
    try:
        for case in cases:
            rows = case["rows"]
            stages = (0, 1)
            mine = case["call"] in (("send_attn_output", "recv_ffn_output") if conn.role == "attention"
                                    else ("recv_attn_output", "send_ffn_output"))
            if conn.role == "attention":
                payload = cs._payload({0: [rows[0]], 1: [rows[1]]})
                conn.control_plane.update_state_from_dp_metadata(payload)
                conn.control_plane.send_dp_metadata_list(payload)
                sent = []
                for s in stages:
                    n = rows[s]
                    h, lg, ids = cs.make_inputs(sc, case["i"], 0, s, 0, n)
                    good = {"hidden_states": h, "context": cs._ctx(0, s, n), "router_logits": lg, "input_ids": ids}
                    want = cs.ffn_fn(h, lg, ids, 0)
                    done = False
                    if mine and case["call"] == "send_attn_output" and case["stage"] == s:
                        bad = dict(good)
                        if case["arg"] == "context":
                            bad["context"] = _attention_context(case["cat"], case["v"], s, 1 - s, n)
                        else:
                            bad[case["arg"]] = _tensor_variant(good[case["arg"]], case["cat"], case["v"])
                        done, _ = _try(out, case, conn.send_attn_output, bad)
                    if not done:
                        conn.send_attn_output(**good)
                    sent.append((s, h, want))
                for s, h, want in sent:
                    ref, got = h, None
                    if mine and case["call"] == "recv_ffn_output" and case["stage"] == s:
                        kw = {"ref_tensor": h, "ubatch_idx": s}
                        if case["arg"] == "ubatch_idx":
                            kw["ubatch_idx"] = None if case["cat"] == "none" else _index_variant(s, 1 - s, case["v"])
                        else:
                            kw["ref_tensor"] = ref = _tensor_variant(torch.zeros_like(h), case["cat"], case["v"])
                        ok, got = _try(out, case, conn.recv_ffn_output, kw)
                        if ok and (got is not ref or not torch.equal(got, want)):
                            out["failures"].append((case["i"], case["call"], f"accepted {case} but the reply "
                                                    "is not exact or not in ref_tensor"))
                        if not ok:
                            got = None
                    if got is None:
                        got = conn.recv_ffn_output(h, s)
                        if not torch.equal(got, want):
                            out["failures"].append((case["i"], "step", f"reply of stage {s} not exact"))
            else:
                payload = conn.control_plane.recv_dp_metadata_list()
                conn.control_plane.update_state_from_dp_metadata(payload)
                prev_ctx = None
                for s in stages:
                    n = rows[s]
                    good = {"ubatch_idx": s, "routing_spec": spec, "recv_input_ids": True}
                    p = None
                    if mine and case["call"] == "recv_attn_output" and case["stage"] == s:
                        bad = dict(good)
                        if case["arg"] == "ubatch_idx":
                            bad["ubatch_idx"] = None if case["cat"] == "none" else _index_variant(s, 1 - s, case["v"])
                        else:
                            bad[case["arg"]] = None if case["cat"] == "none" else _spec_variant(case["arg"], case["v"])
                        _, p = _try(out, case, conn.recv_attn_output, bad)
                    if p is None:
                        p = conn.recv_attn_output(**good)
                    h, lg, ids = cs.make_inputs(sc, case["i"], 0, s, 0, n)
                    if not (torch.equal(p.hidden_states, h) and torch.equal(p.router_logits, lg)
                            and torch.equal(p.input_ids, ids) and list(p.context.metadata.seq_lens) == [n]):
                        out["failures"].append((case["i"], "step", f"fan-in of stage {s} not exact ({case})"))
                    ffn_out = cs.ffn_fn(p.hidden_states, p.router_logits, p.input_ids, 0)
                    done = False
                    if mine and case["call"] == "send_ffn_output" and case["stage"] == s:
                        bad = {"ffn_output": ffn_out, "context": p.context}
                        if case["arg"] == "context":
                            bad["context"] = _ffn_context(case["cat"], case["v"], p.context, prev_ctx, s, 1 - s)
                        else:
                            bad["ffn_output"] = _tensor_variant(ffn_out, case["cat"], case["v"])
                        done, _ = _try(out, case, conn.send_ffn_output, bad)
                    if not done:
                        conn.send_ffn_output(ffn_out, p.context)
                    prev_ctx = p.context
            out["steps"] += 1
    except Exception as e:  # noqa: BLE001 - the first failure ends this rank's run; its peer then times out
        out["failures"].append((-1, "run", f"{type(e).__name__}: {e}"[:600]))
    finally:
        conn.close()
    out["took"] = time.monotonic() - t0
    out["accepted"], out["refused"] = dict(out["accepted"]), dict(out["refused"])
    return out


def test_fuzzed_data_call_arguments_are_delivered_exactly_or_refused_by_name():
    cases = _cases()
    sc = cs.Scenario(A=1, F=1, hidden=HIDDEN, layers=1, logits_width=WIDTH, send_ids=True, strict=False,
                     step_timeout_s=10.0)
    ffn, att = run_workers(_fuzz_worker, 2, (sc, find_free_port(), cases), timeout_s=220)
    failures = ffn["failures"] + att["failures"]
    assert not failures, failures[:10]
    assert ffn["steps"] == att["steps"] == CASES
    acc = collections.Counter(ffn["accepted"]) + collections.Counter(att["accepted"])
    ref = collections.Counter(ffn["refused"]) + collections.Counter(att["refused"])
    assert sum(acc.values()) + sum(ref.values()) == CASES
    by_cat: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for (call, arg, cat), k in acc.items():
        by_cat[cat][0] += k
    for (call, arg, cat), k in ref.items():
        by_cat[cat][1] += k
    # Each category refused something, and the layouts/strides/indices/specs categories accepted something exact.
    assert all(by_cat[c][1] > 0 for c in ("types", "none", "shapes", "dtypes", "devices", "strides", "layouts",
                                          "indices", "specs", "contexts")), dict(by_cat)
    assert all(by_cat[c][0] > 0 for c in ("strides", "indices", "specs", "contexts")), dict(by_cat)
    assert by_cat["none"][0] == 0, dict(by_cat)  # None is no fuzzed argument's value (ubatch_idx=None was taken)
    lines = ", ".join(f"{c} {a}/{r}" for c, (a, r) in sorted(by_cat.items()))
    print(f"\n[issue 34 fuzz] seed {SEED}, {CASES} cases in {max(ffn['took'], att['took']):.1f} s, accepted/refused "
          f"per category: {lines}; every step exact")
