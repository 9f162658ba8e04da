"""Python calls per connector data call: a counter and the measurement of issue #43.

:func:`count_package_calls` counts, with ``sys.setprofile`` on the calling
thread, every ``call`` event (a function, a comprehension, a generator resumed)
whose code lives in the ``afd_ext`` package, except ``transport/gloo.py`` (the
CPU transport; a device transport replaces it), so torch and the standard
library are not counted either. :func:`data_call_counts` is the issue's
measurement: a 1A1F gloo exchange of 1 token (hidden states, router logits and
token ids), 4 layers, strict mode off, each data call counted at layer 2 (a
steady-state call; the first call of a step also builds the step's plan), the
fewer of two steps: a gloo wait longer than its 50 ms slice polls again, so a
loaded machine can add calls to one count. Run ``python tests/call_counts.py``
for the counts and the functions behind them; ``tests/test_call_counts.py``
keeps the ceiling.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from typing import Iterator

import afd_ext

PACKAGE = os.path.dirname(os.path.abspath(afd_ext.__file__)) + os.sep
#: Files of the package left out of the count.
EXCLUDED = (os.path.join(PACKAGE, "transport", "gloo.py"),)
#: The connector's data calls, attention side then FFN side.
DATA_CALLS = ("send_attn_output", "recv_attn_output", "recv_ffn_output", "send_ffn_output")


@contextlib.contextmanager
def count_package_calls(exclude: tuple[str, ...] = EXCLUDED) -> Iterator[collections.Counter]:
    """Count the package's Python calls on this thread while the block runs.

    Yields:
        A ``Counter`` of ``"path/in/afd_ext.py:function"`` -> calls, filled as the block runs;
        ``sum(c.values())`` is the count.
    """
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg):  # noqa: ARG001 - sys.setprofile's signature
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(PACKAGE) and path not in exclude:
                counts[f"{path[len(PACKAGE):]}:{frame.f_code.co_name}"] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(previous)


def _worker(rank: int, nprocs: int, port: int, layers: int, at: int, steps: int) -> dict[str, list[dict]]:
    import connector_scenarios as cs
    import torch

    from afd_ext.metadata import AFDControlPayload, AFDTransferContext, AFDTransferMetadata

    sc = cs.Scenario(A=1, F=1, hidden=8, layers=layers, logits_width=4, send_ids=True, strict=False,
                     transport="gloo")
    conn = cs.make_connector(sc, rank, port)
    conn.init_afd_connector()
    out: dict[str, list[dict]] = collections.defaultdict(list)

    def call(name, fn, *args):
        if layer != at:
            return fn(*args)
        with count_package_calls() as c:
            r = fn(*args)
        out[name].append(dict(c))
        return r

    cp = conn.control_plane
    h, logits, ids = torch.ones(1, sc.hidden), torch.ones(1, 4), torch.zeros(1, dtype=torch.int32)
    try:
        for _ in range(steps):
            if rank < sc.F:
                cp.update_state_from_dp_metadata(cp.recv_dp_metadata_list())
                for layer in range(layers):
                    got = call("recv_attn_output", conn.recv_attn_output, 0)
                    call("send_ffn_output", conn.send_ffn_output, got.hidden_states * 2, got.context)
            else:
                payload = AFDControlPayload(dp_metadata_list={0: [1]})
                cp.update_state_from_dp_metadata(payload)
                cp.send_dp_metadata_list(payload)
                for layer in range(layers):
                    ctx = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(
                        layer_idx=layer, stage_idx=0, seq_len=1))
                    call("send_attn_output", conn.send_attn_output, h, ctx, logits, ids)
                    call("recv_ffn_output", conn.recv_ffn_output, h, 0)
    finally:
        conn.close()
    return dict(out)


def data_call_counts(layers: int = 4, at: int = 2, steps: int = 6) -> dict[str, collections.Counter]:
    """The package's Python calls in each data call at layer ``at`` of ``layers``-layer 1A1F gloo steps.

    Returns:
        ``{data call: Counter("file:function" -> calls)}`` for :data:`DATA_CALLS`, the step with the fewest
        (a receive that waits longer than a wait slice polls again: on a loaded host, the least is the path).
    """
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # connector_scenarios, in the workers too
    from afd_ext.tools.testing import find_free_port, run_workers

    res = run_workers(_worker, 2, (find_free_port(), layers, at, steps), timeout_s=120)
    merged = {k: v for r in res for k, v in r.items()}
    return {k: collections.Counter(min(merged[k], key=lambda c: sum(c.values()))) for k in DATA_CALLS}


if __name__ == "__main__":
    for name, c in data_call_counts().items():
        print(f"{name}: {sum(c.values())}")
        for fn, n in sorted(c.items()):
            print(f"  {n:3d}  {fn}")
