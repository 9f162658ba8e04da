#!/usr/bin/env bash
# Create (once, cached outside the clone, keyed on its pins file and the interpreter) an environment for
# the vLLM integration suite, install afd-plugin from a source tree into it, then build this clone's
# afd_ext into it (every run: the editable install must point at the clone under test).
# Prints "<the environment's python> <the afd-plugin source tree>" on stdout (the only line there).
#
# Variables: AFD_VLLM_ENV_ONLY (1: only make the env, print its python), AFD_VLLM_PINS (a pins file in tests/integration_vllm/, default pins.txt: vLLM 0.26.0;
# pins-vllm030.txt: vLLM 0.30.0), PYTHON (interpreter, default python3), AFD_VLLM_ENV_DIR (the env of
# pins.txt; that of pins-<tag>.txt is $AFD_VLLM_ENV_DIR-<tag>; default ~/.cache/afd_ext/vllm-env-<hash>),
# AFD_PLUGIN_SRC (afd-plugin source tree, installed editable; default a writable copy of
# ../shared/third_party/afd-plugin-2e4378f under the env), AFD_VLLM_MIN_FREE_GB (10).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
pins_name="${AFD_VLLM_PINS:-pins.txt}"
pins="$repo/tests/integration_vllm/$pins_name"
[ -f "$pins" ] || { echo "test-vllm: no pins file $pins (AFD_VLLM_PINS names one in tests/integration_vllm/)" >&2; exit 2; }
tag="${pins_name#pins}"; tag="${tag%.txt}"  # "" for pins.txt, "-vllm030" for pins-vllm030.txt
py="${PYTHON:-python3}"
key="$( { cat "$pins"; "$py" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-12)"
env_dir="${AFD_VLLM_ENV_DIR:+$AFD_VLLM_ENV_DIR$tag}"
env_dir="${env_dir:-${HOME}/.cache/afd_ext/vllm-env-$key}"
vpy="$env_dir/bin/python"
log() { echo "test-vllm: $*" >&2; }

if [ ! -f "$env_dir/.afd-ready" ]; then
    parent="$(dirname "$env_dir")"; mkdir -p "$parent"
    need_gb="${AFD_VLLM_MIN_FREE_GB:-10}"
    free_gb=$(( $(df -Pk "$parent" | awk 'NR==2 {print $4}') / 1024 / 1024 ))
    if [ "$free_gb" -lt "$need_gb" ]; then
        log "not enough free disk for the vLLM env: $free_gb GB free under $parent, need $need_gb GB" \
            "(vLLM with its CUDA torch is about 8 GB). Free space or set AFD_VLLM_ENV_DIR elsewhere."
        exit 2
    fi
    log "creating $env_dir from $pins_name ($free_gb GB free; about 8 GB will be used; this takes a while)"
    rm -rf "$env_dir"
    "$py" -m venv "$env_dir"
    "$vpy" -m pip install --no-cache-dir -q --upgrade pip >&2
    "$vpy" -m pip install --no-cache-dir -q -r "$pins" >&2
    touch "$env_dir/.afd-ready"
else
    log "using cached env $env_dir"
fi
# AFD_VLLM_ENV_ONLY=1: the environment alone (make wheel compiles against its torch): print its python, stop.
[ -z "${AFD_VLLM_ENV_ONLY:-}" ] || { echo "$vpy"; exit 0; }

# afd-plugin from source. The snapshot has no .git, hence the pretended version; no Ascend ops on CPU.
src="${AFD_PLUGIN_SRC:-}"
if [ -z "$src" ]; then
    ref="$repo/../shared/third_party/afd-plugin-2e4378f"
    [ -d "$ref" ] || ref="/work/shared/third_party/afd-plugin-2e4378f"
    [ -d "$ref" ] || { log "no afd-plugin source: set AFD_PLUGIN_SRC to a checkout of vllm-project/afd-plugin@2e4378f"; exit 2; }
    src="$env_dir/afd-plugin-src"
    if [ ! -f "$src/.afd-copied" ] || ! diff -rq "$ref/afd_plugin" "$src/afd_plugin" -x __pycache__ >/dev/null; then
        rm -rf "$src"; cp -r "$ref" "$src"; chmod -R u+w "$src"; touch "$src/.afd-copied"
    fi
fi
if ! "$vpy" -c 'import afd_plugin, os, sys; sys.exit(os.path.realpath(afd_plugin.__path__[0]) != os.path.realpath(sys.argv[1]))' "$src/afd_plugin" 2>/dev/null; then
    log "installing afd-plugin from $src"
    SETUPTOOLS_SCM_PRETEND_VERSION_FOR_VLLM_AFD_PLUGIN="${SETUPTOOLS_SCM_PRETEND_VERSION_FOR_VLLM_AFD_PLUGIN:-0.0.0}" \
    AFD_BUILD_ASCEND_OPS=0 "$vpy" -m pip install --no-cache-dir -q --no-build-isolation --no-deps -e "$src" >&2
fi

# afd_ext from this clone, against the env's torch (CPU build: the suite runs on gloo).
log "building afd_ext from $repo into the env"
(cd "$repo" && AFD_USE_CUDA=0 "$vpy" -m pip install --no-cache-dir -q --no-build-isolation --no-deps -e . >&2)
"$vpy" - "$repo" <<'PY'
import os, sys, afd_ext
got = os.path.dirname(os.path.dirname(os.path.realpath(afd_ext.__file__)))
assert got == os.path.realpath(sys.argv[1]), f"afd_ext resolves to {got}, not the clone {sys.argv[1]}"
PY
echo "$vpy $src"
