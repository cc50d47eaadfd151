"""How a figure is printed, shared by the report's tables and the plots' labels (both import it; it imports
neither)."""

import math
from typing import Any

TINY = 1e-9  # floats below this print as zero


def format_value(fmt: str, value: Any) -> str:
    """``value`` printed with ``fmt``; None as n/a, and a float too small to matter as zero."""
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, float) and abs(value) < TINY:
        value = 0.0  # a fitted slope of -7e-13 is a flat line: print +0.000, not -0.000
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)
