"""Names the box's oldest Python (3.7, CANN's on the Atlas 200 DK) lacks, from typing_extensions there."""

import sys

if sys.version_info >= (3, 8):
    from typing import Final, Literal, Protocol, get_args, get_origin  # novermin - 3.8+ branch
else:  # pragma: no cover - exercised by the Lite lane (Python 3.7)
    from typing_extensions import Final, Literal, Protocol, get_args, get_origin

__all__ = ["Final", "Literal", "Protocol", "get_args", "get_origin"]
