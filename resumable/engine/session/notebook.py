"""Whether training runs in an interactive kernel (a Jupyter/Colab notebook, IPython), where the process is the
user's kernel: resumable must never end it (a hang raises in the cell instead of exiting 76) and learns from the
shell how each cell ended (engine/session/open_runs.py)."""

from __future__ import annotations

import sys
from typing import Any


def shell() -> Any:
    """The running IPython shell, or None. IPython is never imported here: a script that never started a shell has
    none, even when some library imported the IPython package."""
    module = sys.modules.get("IPython")
    get = getattr(module, "get_ipython", None) if module is not None else None
    if get is None:
        return None
    try:
        return get()
    except Exception:  # noqa: BLE001 - a half-imported or broken IPython is no shell
        return None


def interactive() -> bool:
    """True inside a notebook kernel or an IPython shell."""
    return shell() is not None
