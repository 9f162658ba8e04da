"""Which afd_ext ops survive raising an error on this machine (GPU diagnosis).

Each case runs in its own subprocess (one GPU visible) and must end with a
Python ``RuntimeError`` carrying the expected message; a negative exit code
means the process died from a signal while the C++ op raised. When ``gdb`` is
installed, the first crashing case is rerun under it for a C++ backtrace.

    python tests/gpu/diag_throw.py [--out FILE.json]

Exit status: 0 when every case raised cleanly, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

PRE = "import torch, afd_ext.ops as o\n"
CASES = {
    # name: (code, expected message fragment)
    "python_valueerror": ("raise RuntimeError('plain python')", "plain python"),
    "aten_cuda_error": ("torch.zeros(2, device='cuda') + torch.zeros(3, device='cuda')", "size of tensor"),
    "cpu_send_cpu_tensor": ("o.send(torch.zeros(2, 4), 1, 0)", "CUDA tensors"),
    "comm_destroy_never_issued": ("o.comm_destroy(987654)", "was never issued"),
    "comm_get_dead_handle": (
        "o.send(torch.zeros(3, device='cuda'), 987654, 0)", "not a live communicator"),
    "comm_create_bad_rank": (
        "o.comm_create(o.nccl_unique_id(), 2, 5, 0)", "rank must be in"),
    "live_comm_bad_peer": (
        "h = o.comm_create(o.nccl_unique_id(), 1, 0, 0)\n"
        "o.send(torch.zeros(3, device='cuda'), h, 0)", "must be a rank of communicator"),
    "live_comm_split_back_rows": (
        "h = o.comm_create(o.nccl_unique_id(), 1, 0, 0)\n"
        "o.split_back([torch.zeros(4, 8, device='cuda')], [h], [0], [5])", "must be a rank"),
    "direct_torch_ops_call": (
        "torch.ops.afd_ext.send(torch.zeros(3, device='cuda'), 987654, 0)", "not a live communicator"),
}


def run_case(code: str, timeout: float = 60.0) -> tuple[int, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", PRE + code], capture_output=True,
                       text=True, timeout=timeout, env=env)
    return p.returncode, (p.stdout + p.stderr)[-3000:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    results, first_crash = {}, None
    for name, (code, expect) in CASES.items():
        rc, out = run_case(code)
        ok = rc == 1 and expect in out
        results[name] = {"rc": rc, "clean_raise": ok, "tail": out[-600:]}
        print(f"{name:24s} rc={rc:4d} {'raised cleanly' if ok else 'NOT CLEAN'}")
        if not ok:
            print("   " + out[-600:].replace("\n", "\n   "))
        if rc < 0 and first_crash is None:
            first_crash = code
    if first_crash and shutil.which("gdb"):
        g = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable, "-c",
                            PRE + first_crash], capture_output=True, text=True, timeout=180)
        results["gdb"] = g.stdout[-8000:]
        print(g.stdout[-8000:])
    elif first_crash:
        print("gdb not installed: no C++ backtrace")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r.get("clean_raise") for k, r in results.items() if k != "gdb") else 1


if __name__ == "__main__":
    sys.exit(main())
