#!/usr/bin/env bash
# `make test`'s two pytest lanes, side by side: the host lane (the tree's venv) in the foreground, the Lite lane
# (the box's Python 3.7 with the real mindspore-lite) at the same time in the background. Most of each lane's time
# is real time spent waiting on rigs (the fleet and cluster rigs in one, the camera rig in the other), so on a
# 2-core machine the pair takes about as long as the longer lane instead of their sum.
#
#   tests/lanes.sh HOST_PY HOST_MARKS [LITE_PY LITE_MARKS]    without LITE_PY the host lane runs alone
#
# The Lite lane's output goes to a log file, printed whole when it ends (two lanes' progress dots would interleave
# mid-line). Both lanes always run to their end; the script fails if either failed or collected no tests
# (pytest's exit 5). The failed tests of both lanes are listed again last, after the verdicts: a CI log that
# keeps only its tail would otherwise end with the Lite lane's output and hide which host test failed.
set -uo pipefail
HOST_PY=${1:?usage: tests/lanes.sh HOST_PY HOST_MARKS [LITE_PY LITE_MARKS]}
HOST_MARKS=${2:?usage: tests/lanes.sh HOST_PY HOST_MARKS [LITE_PY LITE_MARKS]}
LITE_PY=${3:-}
LITE_MARKS=${4:-}

verdict() {  # verdict LANE RC SECONDS: prints the lane's line, returns non-zero when it failed
    local lane=$1 rc=$2 seconds=$3
    if [ "$rc" -eq 5 ]; then echo "$lane: pytest collected no tests (a broken suite, not a pass)" >&2; return 1; fi
    if [ "$rc" -ne 0 ]; then echo "$lane: FAILED (pytest exit $rc) after $seconds s" >&2; return 1; fi
    echo "$lane: passed in $seconds s"
}

lite_pid=
lite_log=
if [ -n "$LITE_PY" ]; then
    lite_log=$(mktemp /tmp/atlas-edge-lite-lane.XXXXXX.log)
    lite_start=$(date +%s)
    # job control on: a non-interactive shell's background job would otherwise start with SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler for the daemons and tools the tests interrupt
    set -m
    "$LITE_PY" -m pytest -m "$LITE_MARKS" -q -p no:cacheprovider > "$lite_log" 2>&1 &
    lite_pid=$!
    set +m
    trap '[ -n "$lite_pid" ] && kill "$lite_pid" 2>/dev/null' EXIT
    echo "== Lite lane ($("$LITE_PY" --version 2>&1)) runs alongside; its output, printed when it ends: $lite_log"
fi

echo "== host lane ($("$HOST_PY" --version 2>&1))"
host_log=$(mktemp /tmp/atlas-edge-host-lane.XXXXXX.log)
host_start=$(date +%s)
"$HOST_PY" -m pytest -m "$HOST_MARKS" -q 2>&1 | tee "$host_log"
host_rc=${PIPESTATUS[0]}
host_s=$(( $(date +%s) - host_start ))

failed=0
if [ -n "$lite_pid" ]; then
    [ "$host_rc" -eq 0 ] || echo "== host lane failed; waiting for the Lite lane to end"
    wait "$lite_pid"
    lite_rc=$?
    lite_pid=
    lite_s=$(( $(date +%s) - lite_start ))
    echo "== Lite lane output ($lite_log)"
    cat "$lite_log"
    verdict "Lite lane" "$lite_rc" "$lite_s" || failed=1
else
    echo "Lite lane skipped: no Python 3.7"
fi
verdict "host lane" "$host_rc" "$host_s" || failed=1
if [ "$failed" -ne 0 ]; then
    echo "== failed tests (host lane: $host_log${lite_log:+, Lite lane: $lite_log})"
    grep -hE '^(FAILED|ERROR) ' "$host_log" ${lite_log:+"$lite_log"} || echo "(none listed: see the logs above)"
fi
exit "$failed"
