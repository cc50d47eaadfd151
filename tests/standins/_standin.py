"""Shared body of the test stand-ins for ``atc`` and ``converter_lite`` (used only by
tests/unit/converters/test_convert*.py).

A stand-in is NOT the real tool: it checks its arguments (and the files they name) against the documented
grammar in converters/grammar.py, the same validator the generator uses, then behaves as the mode in
$ATLAS_EDGE_STANDIN_MODE says, so the run path of ``atlas-edge convert`` can be tested without an Ascend host:

- ``succeed`` (default): write the output file, print the tool's success line, exit 0;
- ``fail``: print an error and exit 1;
- ``no-success-line``: write the output, exit 0, but never print the success line;
- ``sleep``: sleep far past any test timeout (the caller must kill it);
- ``no-output``: print the success line and exit 0 without writing the output.

With $ATLAS_EDGE_STANDIN_FAIL_MATCH set, a call whose arguments contain that text fails as in ``fail`` (to
fail one tier of several). With $ATLAS_EDGE_STANDIN_RECORD set, each call appends one JSON line
{tool, args, cwd, pid, ld_library_path} to that file.
"""

import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))

from converters import grammar  # noqa: E402  (the repository root is put on sys.path just above)

MODES = ("succeed", "fail", "no-success-line", "sleep", "no-output")
SLEEP_S = 600  # far beyond the few seconds the timeout tests allow


def _record(tool, args):
    path = os.environ.get("ATLAS_EDGE_STANDIN_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"tool": tool, "args": args, "cwd": os.getcwd(), "pid": os.getpid(),
                                     "ld_library_path": os.environ.get("LD_LIBRARY_PATH", "")}) + "\n")


def main(tool, version_text, check, output_of, model_of, success_line):
    """Run a stand-in: ``check(args)`` validates and returns flags, ``output_of(flags)`` names the output."""
    args = sys.argv[1:]
    if args == ["--version"]:
        print(version_text)
        return 0
    _record(tool, args)
    mode = os.environ.get("ATLAS_EDGE_STANDIN_MODE", "succeed")
    if mode not in MODES:
        print("%s stand-in: unknown ATLAS_EDGE_STANDIN_MODE %r" % (tool, mode), file=sys.stderr)
        return 2
    try:
        flags = check(args)
    except grammar.GrammarError as exc:
        print("%s stand-in: arguments rejected by the documented grammar:\n%s" % (tool, exc), file=sys.stderr)
        return 1
    print("%s stand-in: arguments and config files match the documented grammar" % tool)
    match = os.environ.get("ATLAS_EDGE_STANDIN_FAIL_MATCH")
    if mode == "fail" or (match and any(match in arg for arg in args)):
        print("E19999: %s stand-in failing on purpose (mode fail)" % tool, file=sys.stderr)
        return 1
    if mode == "sleep":
        print("%s stand-in: sleeping (mode sleep)" % tool, flush=True)
        time.sleep(SLEEP_S)
        return 0
    if mode != "no-output":
        with open(model_of(flags), "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
        with open(output_of(flags), "w", encoding="utf-8") as handle:
            handle.write("%s stand-in output (not a real model)\nsource sha256 %s\nargs %s\n" % (
                tool, digest, json.dumps(args)))
    if mode != "no-success-line":
        print(success_line)
    return 0
