VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: setup test lint typecheck unit serve clean

# Idempotent: re-running only re-checks what is installed.
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch before anything that depends on it, so pip takes the local CPU wheel.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $@

lint: setup
	$(VENV)/bin/ruff check engine tests bench
	$(VENV)/bin/mypy engine

unit: setup
	$(PY) -m pytest -q

test: lint unit

serve:
	@echo "make serve lands with the cluster issue (proxy + nodes); until then use the offline API: see README"
	@exit 1

clean:
	rm -rf $(VENV)
