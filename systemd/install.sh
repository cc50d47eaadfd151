#!/usr/bin/env bash
# Install atlas-edge as a systemd service on a box. Idempotent: run it again to upgrade; it never overwrites
# the operator's config.yaml, atlas-edge.env or mqtt-password.
#
#   sudo systemd/install.sh [--device NAME] [--wheels DIR] [--instance N]... [--enable] [--dry-run]
#
# What it does (docs/operations.md explains each step):
#   1. system user and group `atlas-edge` (home /var/lib/atlas-edge, no login shell), added to HwHiAiUser
#      when the Ascend driver created that group; on a box without it, a drop-in clears SupplementaryGroups=
#   2. a virtual environment at /opt/atlas-edge/venv with this checkout (or wheels from --wheels DIR, offline)
#      and the `edge` extra; NPU runtimes are not on PyPI: pyACL comes from CANN via PYTHONPATH in the env file,
#      a mindspore_lite wheel is installed into the venv by hand (docs/operations.md)
#   3. the units (atlas-edge.service and the per-NPU template atlas-edge@.service), the env and config
#      examples, an empty root-only mqtt-password (LoadCredential= needs the file); /etc/atlas-edge is not
#      readable by other users (configs may hold stream passwords); with --instance N, the same for
#      /etc/atlas-edge/N (the config, credential and state of atlas-edge@N)
#   4. with --device NAME: a drop-in sizing MemoryHigh=/MemoryMax= from device_configs/NAME.yaml
#   5. systemctl daemon-reload (and enable with --enable); it does not start the service: write the config first
#
# Options:
#   --dry-run      print every action, change nothing
#   --root DIR     install files under DIR instead of / (image builds, tests): no user, no systemctl
#   --device NAME  size the memory limits from device_configs/NAME.yaml (memory_budget_mb)
#   --wheels DIR   pip install from DIR only (--no-index): a box without internet
#   --no-venv      leave the virtual environment alone
#   --python PY    interpreter for the venv (default python3; the box needs >= 3.8)
#   --instance N   prepare atlas-edge@N (NPU N): /etc/atlas-edge/N/ with its examples and mqtt-password;
#                  repeat for each NPU
#   --enable       systemctl enable atlas-edge (starts at boot), or atlas-edge@N for each --instance
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UNIT=atlas-edge.service
USER_NAME=atlas-edge
NPU_GROUP=HwHiAiUser
PYTHON=python3
ROOT=""
DEVICE=""
WHEELS=""
DRY_RUN=0
MAKE_VENV=1
ENABLE=0
INSTANCES=()
TEMPLATE=atlas-edge@.service

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "install.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --root) ROOT=${2:?--root needs a directory}; shift ;;
        --device) DEVICE=${2:?--device needs a name}; shift ;;
        --wheels) WHEELS=${2:?--wheels needs a directory}; shift ;;
        --no-venv) MAKE_VENV=0 ;;
        --python) PYTHON=${2:?--python needs an interpreter}; shift ;;
        --instance)
            [[ ${2:-} =~ ^[0-9]+$ ]] || die "--instance needs an NPU number (got '${2:-}')"
            INSTANCES+=("$2"); shift ;;
        --enable) ENABLE=1 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift
done

ROOT=${ROOT%/}
ETC=$ROOT/etc/atlas-edge
OPT=$ROOT/opt/atlas-edge
VENV=$OPT/venv
SYSTEMD_DIR=$ROOT/etc/systemd/system
DROPIN_DIRS=("$SYSTEMD_DIR/$UNIT.d" "$SYSTEMD_DIR/$TEMPLATE.d")

# Every change goes through run/write_file, so --dry-run shows exactly what a real run would do.
run() {
    printf '+'; printf ' %q' "$@"; printf '\n'
    if [ "$DRY_RUN" = 0 ]; then "$@"; fi
}

write_file() {  # write_file PATH MODE CONTENT
    echo "+ write $1 (mode $2)"
    printf '%s\n' "$3" | sed 's/^/    /'
    if [ "$DRY_RUN" = 0 ]; then
        printf '%s\n' "$3" > "$1.tmp.$$"
        chmod "$2" "$1.tmp.$$"
        mv -f "$1.tmp.$$" "$1"
    fi
}

live_system() { [ -z "$ROOT" ]; }

if [ "$DRY_RUN" = 0 ] && live_system && [ "$(id -u)" != 0 ]; then
    die "run as root (sudo $0 ...), or try --dry-run"
fi
[ -f "$SRC/systemd/$UNIT" ] || die "no $SRC/systemd/$UNIT: run this from an atlas-edge checkout"
if [ -n "$DEVICE" ]; then
    DEVICE_FILE=$SRC/device_configs/$DEVICE.yaml
    [ -f "$DEVICE_FILE" ] || die "no device config $DEVICE_FILE (known: $(cd "$SRC/device_configs" && ls ./*.yaml | sed 's#./##; s/\.yaml$//' | tr '\n' ' '))"
    BUDGET=$(sed -n 's/^memory_budget_mb:[[:space:]]*\([0-9][0-9]*\).*/\1/p' "$DEVICE_FILE")
    [ -n "$BUDGET" ] || die "$DEVICE_FILE has no integer memory_budget_mb"
fi
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then die "--wheels $WHEELS is not a directory"; fi

echo "== atlas-edge install from $SRC${ROOT:+ into $ROOT}$([ "$DRY_RUN" = 1 ] && echo ' (dry run: nothing is changed)')"

# 1. user and groups ------------------------------------------------------------------------------------
if live_system; then
    if getent group "$USER_NAME" >/dev/null; then
        echo "= group $USER_NAME exists"
    else
        run groupadd --system "$USER_NAME"
    fi
    if getent passwd "$USER_NAME" >/dev/null; then
        echo "= user $USER_NAME exists"
    else
        run useradd --system --gid "$USER_NAME" --home-dir /var/lib/atlas-edge --no-create-home \
            --shell /usr/sbin/nologin --comment "atlas-edge inference daemon" "$USER_NAME"
    fi
else
    echo "= --root: user $USER_NAME and group membership are left to the target system"
fi
if getent group "$NPU_GROUP" >/dev/null; then
    HAVE_NPU_GROUP=1
    if live_system; then run usermod --append --groups "$NPU_GROUP" "$USER_NAME"; fi
else
    HAVE_NPU_GROUP=0
    echo "= no $NPU_GROUP group (no Ascend driver here): the service runs without it"
fi

# 2. virtual environment ---------------------------------------------------------------------------------
run install -d -m 0755 "$OPT" "$OPT/share" "$SYSTEMD_DIR"
# configs may hold secrets (an RTSP URL's password): root and the daemon's group only
if live_system; then
    run install -d -m 0750 -g "$USER_NAME" "$ETC"
else
    run install -d -m 0750 "$ETC"
fi
if [ "$MAKE_VENV" = 1 ]; then
    if [ -x "$VENV/bin/python" ]; then
        echo "= venv $VENV exists: upgrading atlas-edge in it"
    else
        run "$PYTHON" -m venv "$VENV"
    fi
    # the package itself is always reinstalled (a rebuilt wheel keeps its version number); its dependencies
    # only when the new one needs others
    if [ -n "$WHEELS" ]; then
        run "$VENV/bin/pip" install --no-index --find-links "$WHEELS" --upgrade "atlas-edge[edge]"
        run "$VENV/bin/pip" install --no-index --find-links "$WHEELS" --force-reinstall --no-deps atlas-edge
    else
        run "$VENV/bin/pip" install --upgrade "$SRC[edge]"
        run "$VENV/bin/pip" install --force-reinstall --no-deps "$SRC"
    fi
else
    echo "= --no-venv: $VENV left as it is"
fi

# 3. unit, examples, credentials -------------------------------------------------------------------------
run install -m 0644 "$SRC/systemd/$UNIT" "$SYSTEMD_DIR/$UNIT"
run install -m 0644 "$SRC/systemd/$TEMPLATE" "$SYSTEMD_DIR/$TEMPLATE"
run install -m 0644 "$SRC/systemd/ip-allow.conf.example" "$OPT/share/ip-allow.conf.example"
run install -m 0644 "$SRC/systemd/atlas-edge.env.example" "$ETC/atlas-edge.env.example"
if [ -f "$SRC/examples/daemon.yaml" ]; then
    run install -m 0644 "$SRC/examples/daemon.yaml" "$ETC/config.yaml.example"
fi
if [ -f "$SRC/docs/operations.md" ]; then
    run install -m 0644 "$SRC/docs/operations.md" "$OPT/share/operations.md"
fi
# 0600: the file may gain MQTT_PASSWORD on boxes whose systemd predates LoadCredential=.
if [ -e "$ETC/atlas-edge.env" ]; then
    echo "= $ETC/atlas-edge.env exists: kept"
else
    run install -m 0600 "$SRC/systemd/atlas-edge.env.example" "$ETC/atlas-edge.env"
fi
keep_or_create_password() {  # the credential LoadCredential= reads: root-only, never overwritten
    if [ -e "$1" ]; then
        echo "= $1 exists: kept"
    else
        run install -m 0600 /dev/null "$1"
    fi
}
keep_or_create_password "$ETC/mqtt-password"
for N in "${INSTANCES[@]}"; do
    if live_system; then
        run install -d -m 0750 -g "$USER_NAME" "$ETC/$N"
    else
        run install -d -m 0750 "$ETC/$N"
    fi
    if [ -f "$SRC/examples/daemon.yaml" ]; then
        run install -m 0644 "$SRC/examples/daemon.yaml" "$ETC/$N/config.yaml.example"
    fi
    keep_or_create_password "$ETC/$N/mqtt-password"
done

# 4. drop-ins --------------------------------------------------------------------------------------------
# the same drop-ins for the single unit and the per-NPU template
for DROPIN_DIR in "${DROPIN_DIRS[@]}"; do
    if [ "$HAVE_NPU_GROUP" = 0 ] || [ -n "$DEVICE" ]; then
        run install -d -m 0755 "$DROPIN_DIR"
    fi
    if [ "$HAVE_NPU_GROUP" = 0 ]; then
        write_file "$DROPIN_DIR/no-npu-group.conf" 0644 "# written by install.sh: this box has no $NPU_GROUP group (no Ascend driver)
[Service]
SupplementaryGroups="
    fi
    if [ -n "$DEVICE" ]; then
        # soft limit (watchdog: the budget) < MemoryHigh (reclaim pressure) < MemoryMax (OOM kill)
        HIGH=$((BUDGET * 5 / 4))
        MAX=$((BUDGET * 3 / 2))
        write_file "$DROPIN_DIR/memory.conf" 0644 "# written by install.sh --device $DEVICE (memory_budget_mb $BUDGET)
[Service]
MemoryHigh=${HIGH}M
MemoryMax=${MAX}M"
    fi
done

# 5. systemd ---------------------------------------------------------------------------------------------
if live_system; then
    run systemctl daemon-reload
    if [ "$ENABLE" = 1 ] && [ ${#INSTANCES[@]} = 0 ]; then run systemctl enable "$UNIT"; fi
    for N in "${INSTANCES[@]}"; do
        if [ "$ENABLE" = 1 ]; then run systemctl enable "atlas-edge@$N.service"; fi
    done
else
    echo "= --root: systemctl daemon-reload is left to the target system"
fi

cat <<EOF
== done. Next:
   1. write $ETC/config.yaml (example: $ETC/config.yaml.example; state_dir: /var/lib/atlas-edge)
      and check it:  $VENV/bin/atlas-edge validate $ETC/config.yaml
   2. NPU boxes: check $ETC/atlas-edge.env against your CANN install's set_env.sh
   3. MQTT password: put it in $ETC/mqtt-password and use 'password: cred:mqtt-password'
   4. systemctl start atlas-edge && journalctl -u atlas-edge -f
   One daemon per NPU instead: the same in $ETC/N/ for each NPU N, then systemctl start atlas-edge@N
   Which addresses the daemon may reach: $OPT/share/ip-allow.conf.example (a drop-in)
EOF
