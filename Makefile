# Two entry points on a fresh machine with Python 3.11+ and pip:
#   make test   set up .venv (torch, build tools, afd_ext in place) and run the CPU test tier
#   make demo   same setup, then run the demo (python -m afd_ext demo)
#   make test-vllm  the vLLM integration suite, in one environment per pins file (VLLM_PINS: vLLM 0.26.0,
#              the whole suite; vLLM 0.30.0, a part), each from PyPI, about 8 GB, cached outside the
#              clone; afd-plugin from AFD_PLUGIN_SRC; docs/vllm.md)
#   make wheel  the binary wheel in dist/ (scripts/wheel.sh): torch's stable ABI and Python's limited API, so one
#              wheel serves CPython 3.11+ and torch 2.11 through the newest; compiled against WHEEL_PY's torch
#              (default: torch 2.11 of test-vllm's vLLM 0.26 environment, made once), kernels for sm_90, sm_100
#              and PTX (WHEEL_ARCH_LIST), checked by auditwheel
#   make test-wheel  the CPU tier on that wheel, installed into $(WHEEL_VENV) with the newest torch
# Other targets: setup, cmake-check (CMake compiles the CPU part of the same sources), clean.
#
# The extension is compiled once and again only when its inputs change: a file under csrc/,
# setup.py, pyproject.toml, or the build key (setup.py's build_key(): Python ABI, the torch build,
# the NCCL wheel, the CUDA toolkit, AFD_USE_CUDA, TORCH_CUDA_ARCH_LIST, CXX/CC). A missing
# afd_ext/_C*.so rebuilds too; `make clean` forces a rebuild. Stamps live in $(VENV).
#
# Variables: PYTHON (interpreter that creates .venv), VENV, MAX_JOBS (parallel compile jobs),
# TORCH_CUDA_ARCH_LIST (default 9.0), AFD_USE_CUDA=0/1 (force CPU-only / require CUDA),
# PYTEST_ARGS (extra pytest arguments), DEMO_ARGS (extra demo arguments), VLLM_PINS (test-vllm's
# environments, pins files in tests/integration_vllm/).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MAX_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
TORCH_CUDA_ARCH_LIST ?= 9.0
CUDA_HOME ?= $(shell [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda)
PYTEST_ARGS ?=
DEMO_ARGS ?=
VLLM_PINS ?= pins.txt pins-vllm030.txt
WHEEL_PY ?=
WHEEL_VENV ?= .venv-wheel

export MAX_JOBS TORCH_CUDA_ARCH_LIST
ifneq ($(strip $(CUDA_HOME)),)
export CUDA_HOME
endif

.PHONY: test test-vllm wheel test-wheel demo setup cmake-check clean FORCE

# Stamps in the venv: a new venv starts from nothing.
TOOLS_STAMP := $(VENV)/.afd_ext-tools
BUILD_KEY := $(VENV)/.afd_ext-build-key
BUILT_STAMP := $(VENV)/.afd_ext-built
BUILD_INPUTS := $(shell find csrc -type f 2>/dev/null) setup.py pyproject.toml

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# torch first (the build compiles against it), then the build tools; once per venv.
$(TOOLS_STAMP): $(PY)
	$(PIP) install "torch>=2.11"
	$(PIP) install setuptools wheel ninja pybind11 numpy
	touch $@

# Recomputed on every run but rewritten only when its text changes, so its
# modification time moves only when the torch build or a build setting did.
$(BUILD_KEY): $(TOOLS_STAMP) FORCE
	@$(PY) -c "import runpy; print(runpy.run_path('setup.py')['build_key']())" > $@.new
	@if cmp -s $@.new $@; then rm -f $@.new; else mv -f $@.new $@; echo "afd_ext: build key (a change rebuilds the extension):"; sed 's/^/  /' $@; fi

# The package in place without build isolation, so the torch above is the one
# compiled against. Forced when no compiled core is present (e.g. after `make clean`).
$(BUILT_STAMP): $(BUILD_KEY) $(BUILD_INPUTS) $(if $(wildcard afd_ext/_C*.so),,FORCE)
	$(PIP) install --no-build-isolation -e ".[test,demo,bench]"
	$(PY) -c "import json, afd_ext.ops as o; print('afd_ext build:', json.dumps(o.build_info()))"
	touch $@

setup: $(BUILT_STAMP)

FORCE:

# The CPU tier; pytest exits 5 when no test ran, which fails the target.
test: setup
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS) || { rc=$$?; \
	  [ $$rc -eq 5 ] && echo "make test: no tests ran (pytest exit 5) -- that is a failure"; exit $$rc; }

# Per pins file, tests/integration_vllm/env.sh makes (once) and reuses the env, installs afd-plugin, builds
# this clone into it (in place: the extension then matches that env's torch, so the .venv build is redone
# by the next `make test`), and prints "<python> <afd-plugin source>". Its variables: that script.
test-vllm:
	@for pins in $(VLLM_PINS); do start=$$(date +%s); \
	  out=$$(AFD_VLLM_PINS=$$pins bash tests/integration_vllm/env.sh) && set -- $$out && rm -f $(BUILT_STAMP) && \
	  echo "test-vllm ($$pins): environment ready in $$(( $$(date +%s) - start )) s" && \
	  AFD_PLUGIN_SRC="$$2" "$$1" -m pytest tests/integration_vllm $(PYTEST_ARGS) && \
	  echo "test-vllm ($$pins): passed in $$(( $$(date +%s) - start )) s" || exit 1; done

wheel: $(TOOLS_STAMP)
	py="$(WHEEL_PY)"; [ -n "$$py" ] || py=$$(AFD_VLLM_ENV_ONLY=1 bash tests/integration_vllm/env.sh) && \
	  TOOLS_PY=$(PY) bash scripts/wheel.sh build "$$py"

test-wheel:
	[ -x $(WHEEL_VENV)/bin/python ] || $(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --upgrade "torch>=2.11"
	bash scripts/wheel.sh test $(abspath $(WHEEL_VENV))/bin/python $(PYTEST_ARGS)

demo: setup
	$(PY) -m afd_ext demo $(DEMO_ARGS)

# CMake compiles the CPU part of csrc/sources.txt (the list setup.py builds; run after setup)
# and the result registers exactly the ops of the pip build.
cmake-check: $(PY)
	cmake -S . -B build/cmake -DPython_EXECUTABLE=$(abspath $(PY)) -DAFD_USE_CUDA=OFF
	cmake --build build/cmake -j $(MAX_JOBS)
	$(PY) -c "import glob, subprocess, sys, torch; torch.ops.load_library(glob.glob('build/cmake/_C*.so')[0]); \
	  ops = lambda: sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith('afd_ext::')); \
	  names = ops(); pip = subprocess.run([sys.executable, '-c', 'import torch, afd_ext.ops; print(sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(\"afd_ext::\")))'], capture_output=True, text=True, check=True).stdout.strip(); \
	  print('cmake build registers', len(names), 'ops'); assert str(names) == pip, (names, pip)"

clean:
	rm -rf build dist afd_ext/_C*.so *.egg-info $(BUILT_STAMP) $(BUILD_KEY)
