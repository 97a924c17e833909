"""The user's cache and state folders, as the XDG base-directory specification names them.

An unset, empty or relative ``$XDG_CACHE_HOME`` / ``$XDG_STATE_HOME`` is ignored, as the
specification says: a relative one would put edgefl's files wherever the command happens to run
(the repository's own ``edgefl/`` package, when run from a checkout).
"""

from __future__ import annotations

import os
from pathlib import Path


def _xdg(variable: str, default: Path) -> Path:
    value = os.environ.get(variable, "")
    return Path(value) if value and Path(value).is_absolute() else default


def cache_home() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``."""
    return _xdg("XDG_CACHE_HOME", Path.home() / ".cache")


def state_home() -> Path:
    """``$XDG_STATE_HOME``, else ``~/.local/state``."""
    return _xdg("XDG_STATE_HOME", Path.home() / ".local" / "state")
