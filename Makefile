# atlas-edge: the two commands a newcomer needs are `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
MINDSPORE_GS := mindspore-gs==1.3.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv demo test lint imports pycompat mosquitto rabbitmq camera-rig demo-bundle bench bench-quick \
	install-service clean lite test-lite test-wheel systemd-tools test-systemd prometheus chromium arm64-tools test-arm64 \
	wheelhouse

# The Lite lane: a Python 3.7 venv with mindspore-lite 2.0.0 (PyPI's only wheel of it is for CPython 3.7), the
# box package and the test runner. The box's oldest Python is 3.7 (CANN on the Atlas 200 DK), so the whole
# suite runs again here. PYTHON37 is `python3.7` when it runs, else pyenv's 3.7; empty when neither exists.
LITE_VENV ?= .venv-lite
LITE_PY := $(LITE_VENV)/bin/python
PYTHON37 ?= $(shell for p in python3.7 "$$(pyenv prefix 3.7 2>/dev/null)/bin/python" \
	$$HOME/.pyenv/versions/3.7*/bin/python; do "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 7)' \
	2>/dev/null && { command -v "$$p" || echo "$$p"; } && break; done)

venv: $(VENV)/.installed

# One virtual environment with the box, host and dev extras. mindspore-gs is installed without its
# dependencies: its pins drag in `datasets` and `mindone`, which QAT does not use (docs/quant.md).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[edge,host,dev,ort,metrics]'
	$(PY) -m pip install -q --no-deps $(MINDSPORE_GS)
	touch $@

lite: $(LITE_VENV)/.installed

$(LITE_VENV)/.installed: pyproject.toml
	@[ -n "$(PYTHON37)" ] || { echo "make lite: no Python 3.7 found (tried python3.7 on PATH and pyenv's 3.7)." \
		"Install one (e.g. 'pyenv install 3.7') or pass PYTHON37=/path/to/python3.7." >&2; exit 2; }
	$(PYTHON37) -m venv $(LITE_VENV)
	$(LITE_PY) -m pip install -q --upgrade pip
	$(LITE_PY) -m pip install -q -e '.[edge,lite,test,ort,metrics]'
	touch $@

# The embedded broker of the demo and the tests' broker are a real Mosquitto from the system packages.
mosquitto:
	@command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq mosquitto)

# The cluster lane's broker (tests/system/cluster/test_cluster.py): RabbitMQ with its MQTT plugin, from Debian.
# The tests start their own nodes from /usr/lib/rabbitmq/bin, never the system service (the package's postinst
# may not start it).
rabbitmq:
	@[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends rabbitmq-server)

# The metrics tests' scraper (tests/support/prometheus.py): a real Prometheus from Debian's package. The tests start
# their own server (a temporary config and TSDB, a free loopback port), never the system service.
# The web console's browser tests (tests/system/console): Debian's Chromium and its chromedriver, driven by Selenium
# (the dev extra); the same package versions, so the driver always matches the browser.
chromium:
	@[ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends chromium chromium-driver)

prometheus:
	@[ -x /usr/bin/prometheus ] || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends prometheus)

# The camera rig of the tests and benchmarks (agent/devtools/camera_rig.py) is a real RTSP server: GStreamer's gst-rtsp-server with x264,
# scripted from the system Python through PyGObject (the venvs do not carry gi; the box never needs it).
CAMERA_RIG_PACKAGES := gstreamer1.0-rtsp gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-ugly \
	gstreamer1.0-plugins-good gstreamer1.0-plugins-base python3-gi
camera-rig:
	@/usr/bin/python3 -c 'import gi; gi.require_version("GstRtspServer", "1.0"); from gi.repository import Gst; \
		Gst.init(None); assert Gst.ElementFactory.find("x264enc")' 2>/dev/null || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends $(CAMERA_RIG_PACKAGES))

demo: venv mosquitto
	$(BIN)/atlas-edge demo --frames 24

lint: venv
	$(BIN)/ruff check .

# The boundaries between agent/'s groups (pyproject.toml [tool.importlinter], docs/architecture.md).
imports: venv
	$(BIN)/lint-imports

# agent/ runs on the boxes' Python 3.7, and converters/ in the Lite lane: fail if any construct needs newer.
pycompat: venv
	$(BIN)/vermin --no-tips --violations --target=3.7- --eval-annotations agent converters

# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
# With a Python 3.7 the Lite venv is built first, so the host lane's conversion tests find it too.
# The rig tests that take minutes of real time run once per `make test`, on the side that runs the code in the
# field: the camera rig on the box's Python 3.7 (Lite lane), the fleet and cluster rigs on the operator's
# workstation (host lane). Without a Python 3.7 the host lane runs them all. `pytest -m camera_rig` runs one kind.
HOST_MARKS = not slow$(if $(PYTHON37), and not camera_rig)
LITE_MARKS = not slow and not fleet_rig

# The host and Lite lanes run side by side (tests/lanes.sh): each spends most of its time waiting on its rigs.
test: venv mosquitto rabbitmq camera-rig prometheus chromium lint imports pycompat $(if $(PYTHON37),lite)
	@tests/lanes.sh $(PY) "$(HOST_MARKS)" $(if $(PYTHON37),$(LITE_PY) "$(LITE_MARKS)")
	@$(MAKE) --no-print-directory test-wheel
	@$(MAKE) --no-print-directory test-systemd
	@$(MAKE) --no-print-directory test-arm64

# The box as a user installs it (tests/system/installed/lane.sh): the wheel built from this tree, installed into a fresh
# venv under /tmp (from a wheelhouse cached in ~/.cache/atlas-edge), the daemon run from another directory, and
# box tests run against site-packages, never the tree. Python 3.11, and the box's 3.7 where there is one.
test-wheel: venv mosquitto
	@start=$$(date +%s); tests/system/installed/lane.sh $(PY) || exit $$?; \
	echo "wheel lane (Python 3.11): $$(( $$(date +%s) - start )) s"
	@if [ -n "$(PYTHON37)" ]; then start=$$(date +%s); tests/system/installed/lane.sh $(PYTHON37) || exit $$?; \
	echo "wheel lane (Python 3.7): $$(( $$(date +%s) - start )) s"; else echo "wheel lane on 3.7 skipped: no Python 3.7"; fi

# The shipped units and install.sh under a real systemd 252 (tests/system/systemd): a Debian 12 container booted with
# systemd-nspawn, its tree cached in ~/.cache/atlas-edge. Needs root; the tools come from Debian's packages.
SYSTEMD_LANE_TIMEOUT ?= 600
systemd-tools:
	@command -v systemd-nspawn >/dev/null && command -v debootstrap >/dev/null && command -v nsenter >/dev/null || \
		($(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			systemd-container debootstrap util-linux)

# SIGINT at the limit: pytest's session teardown still powers the container off (it also has its own limit).
test-systemd: venv
	@if [ "$$(id -u)" != 0 ]; then echo "systemd lane skipped: systemd-nspawn boots containers as root only"; \
	elif ! command -v systemd-nspawn >/dev/null && ! command -v apt-get >/dev/null; then \
		echo "systemd lane skipped: no systemd-nspawn, and no apt-get to install systemd-container"; \
	else $(MAKE) --no-print-directory systemd-tools || exit $$?; start=$$(date +%s); \
		timeout -s INT -k 60 $(SYSTEMD_LANE_TIMEOUT) $(BIN)/pytest -q -rP -p no:cacheprovider tests/system/systemd; \
		rc=$$?; echo "systemd lane: $$(( $$(date +%s) - start )) s"; \
		if [ $$rc -eq 5 ]; then echo "systemd lane collected no tests" >&2; exit 1; fi; exit $$rc; fi

# The box on its own CPU (tests/system/arm64, docs/install-boxes.md): a Debian 11 arm64 root (debootstrap, cached in
# ~/.cache/atlas-edge) run through qemu-user, the box installed there with --no-index and no network from the wheelhouse
# `atlas-edge wheelhouse` makes of this tree, the daemon's detections compared with x86's under two emulated cores
# (QEMU_CPU cortex-a53 and cortex-a76), and the box's own tests (-m box) there. Root only: binfmt_misc, chroot,
# namespaces. Where that cannot be, pytest's summary says "aarch64 lane skipped: WHY".
# Under stress-ng --cpu 2 on a 2-core machine its emulated runs alone took 1,395 s: the lane ran past a 1,500 s bound.
ARM64_LANE_TIMEOUT ?= 2700
arm64-tools:
	@command -v qemu-aarch64-static >/dev/null && command -v debootstrap >/dev/null && command -v unshare >/dev/null \
		&& command -v ip >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends qemu-user-static binfmt-support debootstrap util-linux iproute2)

test-arm64: venv
	@if [ "$$(id -u)" != 0 ]; then echo "aarch64 lane skipped: not root (binfmt_misc, chroot and namespaces need it)"; \
	elif [ ! -d /proc/sys/fs/binfmt_misc ]; then echo "aarch64 lane skipped: this kernel has no binfmt_misc"; \
	elif ! $(MAKE) --no-print-directory arm64-tools; then \
		echo "aarch64 lane skipped: qemu-user-static/debootstrap could not be installed"; \
	else start=$$(date +%s); \
		timeout -s INT -k 60 $(ARM64_LANE_TIMEOUT) $(BIN)/pytest -q -rfEsP -p no:cacheprovider tests/system/arm64; \
		rc=$$?; echo "aarch64 lane: $$(( $$(date +%s) - start )) s"; \
		if [ $$rc -eq 5 ]; then echo "aarch64 lane collected no tests" >&2; exit 1; fi; exit $$rc; fi

# A box's offline wheelhouse (docs/install-boxes.md): `make wheelhouse WHEELHOUSE_PYTHON=3.7` for the Atlas 200 DK.
WHEELHOUSE_PYTHON ?= 3.9
WHEELHOUSE_PLATFORM ?= aarch64
wheelhouse: venv
	$(BIN)/atlas-edge wheelhouse --python $(WHEELHOUSE_PYTHON) --platform $(WHEELHOUSE_PLATFORM) \
		--out out/wheelhouse-py$(WHEELHOUSE_PYTHON)-$(WHEELHOUSE_PLATFORM)

# The whole suite on the box's oldest Python with the real mindspore_lite, less the fleet rigs (LITE_MARKS);
# host-only tests skip themselves (no MindSpore there) and tests/conftest.py does not collect quant/'s.
test-lite: lite mosquitto rabbitmq camera-rig
	$(LITE_PY) -m pytest -m "$(LITE_MARKS)" -q -p no:cacheprovider; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest (Lite lane) collected no tests" >&2; exit 1; fi; exit $$rc

demo-bundle: venv
	$(BIN)/atlas-edge qat --config quant/examples/shapes.yaml --out examples/demo-bundle

# `python -m agent` from the checkout: benchmarks/ is not installed (pyproject.toml), so the console script alone
# would not find it; the working directory on sys.path does.
bench: venv mosquitto camera-rig
	$(PY) -m agent bench --json benchmarks/results.json --plots benchmarks/plots --update-readme

bench-quick: venv mosquitto
	$(PY) -m agent bench --quick --json benchmarks/results-quick.json

install-service:
	$(SUDO) systemd/install.sh

clean:
	rm -rf $(VENV) $(LITE_VENV) .pytest_cache .ruff_cache .hypothesis
