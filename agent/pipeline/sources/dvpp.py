"""The hardware-decoder seam of a camera's worker: Ascend DVPP's video decoder (VDEC), selected by
``decoder: dvpp``. Not written yet and never run (no Ascend here): opening names what is missing, as the
source's error with cause ``config``. docs/sources.md says how VDEC plugs in at this point.
"""

from typing import Any, Dict


def open_dvpp(spec: Dict[str, Any]) -> Any:
    """A capture whose frames DVPP decodes; today always an ImportError naming what is missing."""
    try:
        import acl  # noqa: F401  (pyACL, from CANN)
    except ImportError:
        raise ImportError("decoder 'dvpp' needs pyACL's media API (the acl module of Ascend CANN), which is not "
                          "installed here; use decoder 'opencv'") from None
    raise ImportError("decoder 'dvpp': the VDEC channel is not implemented in this release (docs/sources.md, "
                      "'Hardware decoding'); use decoder 'opencv'")
