"""Plain progress lines for output that is not a terminal (a log file, a pipe, CI).

Rich's live bars draw nothing when stderr is not a terminal, so a long round, an evaluation or a
measurement would leave a log silent for minutes. A :class:`Heartbeat` holds a one-line status
that the work updates as it goes; a daemon thread prints it whenever nothing was printed for
``every_s`` seconds. On a terminal it stays quiet (the bars show the same thing).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rich.console import Console


class Heartbeat:
    def __init__(self, console: Console, every_s: float = 10.0, enabled: bool | None = None) -> None:
        self.console = console
        self.every_s = every_s
        self.enabled = (not console.is_terminal) if enabled is None else enabled
        self.text = ""
        self._started = time.monotonic()
        self._last = self._started
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def status(self, text: str) -> None:
        self.text = text

    def printed(self) -> None:
        """Something else was just printed: the next heartbeat waits a full interval."""
        self._last = time.monotonic()

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s)):
            now = time.monotonic()
            if self.text and now - self._last >= self.every_s:
                self.console.print(f"[{now - self._started:.0f} s] {self.text}", markup=False, highlight=False)
                self._last = now

    def __enter__(self) -> Heartbeat:
        if self.enabled:
            self._thread = threading.Thread(target=self._beat, name="edgefl-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
