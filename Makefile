# atlas-edge: the two commands a newcomer needs are `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
MINDSPORE_GS := mindspore-gs==1.3.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv demo test lint pycompat mosquitto demo-bundle bench bench-quick install-service clean

venv: $(VENV)/.installed

# One virtual environment with the box, host and dev extras. mindspore-gs is installed without its
# dependencies: its pins drag in `datasets` and `mindone`, which QAT does not use (docs/quant.md).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[edge,host,dev]'
	$(PY) -m pip install -q --no-deps $(MINDSPORE_GS)
	touch $@

# The embedded broker of the demo and the tests' broker are a real Mosquitto from the system packages.
mosquitto:
	@command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq mosquitto)

demo: venv mosquitto
	$(BIN)/atlas-edge demo --frames 24

lint: venv
	$(BIN)/ruff check .

# agent/ runs on the boxes' Python 3.8: fail if any construct needs newer.
pycompat: venv
	$(BIN)/vermin --no-tips --violations --target=3.8- --eval-annotations agent

# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
test: venv mosquitto lint pycompat
	$(BIN)/pytest -m "not slow" -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

demo-bundle: venv
	$(BIN)/atlas-edge qat --config quant/examples/shapes.yaml --out examples/demo-bundle

bench: venv mosquitto
	$(BIN)/atlas-edge bench --json benchmarks/results.json --plots benchmarks/plots --update-readme

bench-quick: venv mosquitto
	$(BIN)/atlas-edge bench --quick --json benchmarks/results-quick.json

install-service:
	$(SUDO) systemd/install.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
