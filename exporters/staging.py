"""One model's files are built in a hidden staging folder and moved into place together.

A model's exports are only useful as a set (each file with its sidecar, the int8 file next to the
float one it was judged against), so nothing of a model reaches the output folder until every
file passed its checks: a failure, Ctrl-C or a full disk removes the staging folder and leaves the
previous set, if any, untouched. A successful export replaces the model's previous set whole, so
old sidecars never sit beside new files. The move itself runs with SIGINT and SIGTERM held back
(they are delivered right after), so an interruption cannot split it; only a power cut during
the few renames could, and the next export of that model removes what such a cut left behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from edgefl.exporters.registry import ExportError

_PREFIX = ".edgefl-staging-"


def file_error(exc: OSError, what: str) -> ExportError:
    """An OSError as one line with a hint (a full disk, a read-only folder, a missing one)."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        hint = "the disk is full: free some space, or pass --out on another disk"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "pass a folder you can write with --out"
    else:
        hint = "check the output folder (--out), then export again"
    return ExportError(f"cannot {what}: {reason}", hint=hint)


def model_set(folder: Path, name: str, suffixes: tuple[str, ...]) -> list[Path]:
    """The files of model ``name`` now in ``folder`` (NAME + each suffix, and their sidecars)."""
    names = [name + s for s in suffixes]
    return [folder / n for n in names + [n + ".json" for n in names] if (folder / n).exists()]


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield  # signals reach only the main thread; Windows has no signal mask
        return
    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Staging:
    """A hidden folder inside ``out`` for one model's files; :meth:`commit` moves them into ``out``.

    ``suffixes``: the endings of every file a model's set may have (all registered formats'), so
    that a commit removes the previous set whole."""

    def __init__(self, out: Path, name: str, suffixes: tuple[str, ...]) -> None:
        self.out, self.name, self.suffixes = out, name, suffixes
        for stale in out.glob(f"{_PREFIX}{name}-*"):  # left by a power cut or a kill -9
            shutil.rmtree(stale, ignore_errors=True)
        try:
            self.path = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{name}-", dir=out))
        except OSError as exc:
            raise file_error(exc, f"create a folder in {out}") from None

    def commit(self) -> dict[Path, Path]:
        """Replace the model's set in ``out`` by the staged files; returns staged -> final paths."""
        moved: dict[Path, Path] = {}
        try:
            with _signals_held():
                for old in model_set(self.out, self.name, self.suffixes):
                    old.unlink()
                for staged in sorted(self.path.iterdir()):
                    final = self.out / staged.name
                    os.replace(staged, final)
                    moved[staged] = final
        except OSError as exc:
            raise file_error(exc, f"move {self.name}'s files into {self.out}") from None
        finally:
            self.discard()
        return moved

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
