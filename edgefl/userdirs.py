"""The user's cache and state folders, as the XDG base-directory specification names them, and
the check that a folder a command will write into can take files.

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


def check_writable(folder: Path, what: str, hint: str) -> None:
    """Make ``folder`` and write a file into it, or raise one line saying so (``what`` names the
    folder in it) with ``hint``: said before any work, not after it."""
    from edgefl.errors import EdgeflError

    clash = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if clash is not None:  # mkdir would say "File exists" (or "Not a directory"): say which file is in the way
        where = "is a file, not a folder" if clash == folder else f"is under {clash}, which is a file, not a folder"
        raise EdgeflError(f"cannot write {what} {folder}: it {where}", hint=hint)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".edgefl-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise EdgeflError(f"cannot write {what} {folder}: {exc.strerror or exc}", hint=hint) from None
