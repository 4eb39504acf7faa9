"""Numbers read from environment variables, checked the same way everywhere: unset or empty gives the default,
anything else must be a finite number in range, or the error names the variable, what it takes and the default."""

from __future__ import annotations

import math
import os


def env_number(name: str, default: float, *, minimum: float = 0.0, inclusive: bool = False,
               what: str = "a number of seconds", integer: bool = False) -> float:
    """``$name`` as a number ``> minimum`` (``>=`` when ``inclusive``), an int when ``integer``; else ``default``.

    Raises ValueError naming the variable, the range and the default, for anything else (text, nan, inf, out of
    range): a mistyped setting must not silently become the default."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
        if integer:
            value = int(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value >= minimum if inclusive else value > minimum)):
        bound = f"{'>=' if inclusive else '>'} {minimum:g}"
        raise ValueError(f"{name}={raw!r} is not {what} {bound}; unset it for the default {default:g}")
    return value
