"""What MindIR version a file is, read before a converter that cannot take it fails on it.

A MindIR file is a protobuf ``ModelProto`` (mindspore ``mindspore/core/proto/mind_ir.proto``); its top-level
field 13, ``mind_ir_version``, is what the loader compares with the most it supports. MindSpore 2.7 writes 3;
MindSpore Lite 2.0.0 refuses anything above 1 ("This software can only support the maximum mind ir version:
1, please install the latest version to support the mind ir version: 3", measured in its converter and at
load). Reading the field takes the top-level walk below (no protobuf dependency): length-delimited fields,
the graph included, are skipped by their length.
"""

import re
from typing import Dict, Optional, Tuple

MIND_IR_VERSION_FIELD = 13
PRODUCER_VERSION_FIELD = 5  # "2.7.1.post1": the MindSpore that exported it, for messages
WIRE_VARINT, WIRE_FIXED64, WIRE_LENGTH, WIRE_FIXED32 = 0, 1, 2, 5
# The newest MindIR version each MindSpore Lite release line reads, as measured; a line not listed is not
# checked beforehand (its converter says so itself).
MAX_MINDIR_VERSION: Dict[str, int] = {"2.0": 1}


class MindIrError(ValueError):
    """Not a MindIR file (the top-level protobuf walk failed)."""


def _varint(data: bytes, pos: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise MindIrError("truncated varint at byte %d" % pos)
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def read_header(path: str) -> Tuple[int, str]:
    """(mind_ir_version, producer version) of a MindIR file; version 0 when the field is absent (old files)."""
    with open(path, "rb") as handle:
        data = handle.read()
    version, producer, pos = 0, "", 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == WIRE_VARINT:
            value, pos = _varint(data, pos)
            if field == MIND_IR_VERSION_FIELD:
                version = value
        elif wire == WIRE_LENGTH:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise MindIrError("%s: field %d runs past the end of the file" % (path, field))
            if field == PRODUCER_VERSION_FIELD:
                producer = data[pos:pos + size].decode("utf-8", "replace")
            pos += size
        elif wire in (WIRE_FIXED64, WIRE_FIXED32):
            pos += 8 if wire == WIRE_FIXED64 else 4
        else:
            raise MindIrError("%s: not a MindIR protobuf (wire type %d at byte %d)" % (path, wire, pos))
    return version, producer


def max_readable(lite_version: str) -> Optional[int]:
    """The newest MindIR version MindSpore Lite ``lite_version`` reads, or None when not known here."""
    match = re.match(r"(\d+\.\d+)", lite_version)
    return MAX_MINDIR_VERSION.get(match.group(1)) if match else None
