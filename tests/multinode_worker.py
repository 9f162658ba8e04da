"""One AFD rank started by torchrun on a "host" of tests/test_multinode.py (not a test module).

Usage: ``torchrun ... tests/multinode_worker.py SCENARIO OUT_DIR``. The rank
takes its role, role rank and rendezvous address from torchrun's environment
only (:func:`afd_ext.tools.launch.config_from_env`) and writes
``OUT_DIR/rank<RANK>.json``: its role, host name, control-channel kinds and
what it checked.

Scenarios:

* ``steps``: :func:`connector_scenarios.default_steps` (uneven counts,
  zero-token ranks, a two-stage step, an idle step); every attention rank
  checks every reply exactly.
* ``kill``: after step 0, the last attention rank SIGKILLs itself before
  layer 1 of step 1 (half a second after the others sent theirs); the others record the error they get, then re-raise it
  (a real program would fail; it also keeps torchrun from waiting for the dead
  host at its exit barrier).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

import connector_scenarios as cs  # this directory is sys.path[0]
import torch

from afd_ext.connector import AFDConnector
from afd_ext.tools.launch import config_from_env

STEP_TIMEOUT_S = 8.0


def main(scenario: str, out_dir: str) -> None:
    role, role_rank, cfg = config_from_env(connector_extra_config={
        "transport": "gloo", "strict": True, "step_timeout_s": STEP_TIMEOUT_S, "init_timeout_s": 60.0,
        "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 10.0})
    A, F = cfg.num_attention_ranks, cfg.num_ffn_ranks
    steps = cs.default_steps(A) if scenario == "steps" else ({0: [2] * A}, {0: [2 + a for a in range(A)]})
    sc = cs.Scenario(A=A, F=F, steps=steps, step_timeout_s=STEP_TIMEOUT_S)
    rank = int(os.environ["RANK"])
    out: dict = {"role": role, "role_rank": role_rank, "host": socket.gethostname(), "afd_host": cfg.host,
                 "afd_port": cfg.port}
    conn = AFDConnector(rank, 0, cfg, role_rank, hidden_size=sc.hidden, num_layers=sc.layers,
                        dtype=torch.float32, device=torch.device("cpu"))
    error: BaseException | None = None
    try:
        conn.init_afd_connector()
        out["control"] = sorted(ch.kind for ch in conn.control_plane.channels.values())
        victim = role == "attention" and role_rank == A - 1 and scenario == "kill"
        try:
            if role == "ffn":
                out["rows"] = [cs.ffn_step(conn, sc)[0] for _ in sc.steps]
            else:
                def die(layer, stage, t):
                    if victim and layer == 1:
                        time.sleep(0.5)  # the other ranks' layer-1 rows arrive first: only this one is missing
                        os.kill(os.getpid(), signal.SIGKILL)
                    return t
                out["checked"] = [cs.attention_step(conn, sc, i, step, bad=die if i == 1 else None)
                                  for i, step in enumerate(sc.steps)]
        except Exception as e:  # noqa: BLE001 - recorded for the test, then re-raised
            out["error"] = [type(e).__name__, str(e)]
            error = e
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        conn.close()
    if error is not None:
        raise error


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
