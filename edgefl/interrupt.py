"""Ctrl-C and SIGTERM that stop a run cleanly: the first finishes the current round, then the run
writes its models, summary and plots; a second stops at once (what is done is still written).

A long run killed by an operator (SIGTERM from a scheduler, Ctrl-C at a terminal) must not lose
the rounds it already played: the signal only sets a flag that the round loop reads between
rounds. Handlers are installed for the duration of a ``with`` block and restored afterwards, and
only in the main thread (where Python delivers signals).

The second signal raises KeyboardInterrupt wherever the main thread is (mid-round: the round is
abandoned and the run ends with what its finished rounds saved). Once the run is stopping anyway
-- the round loop has read the request between rounds, or the second signal already raised -- a
further signal only says so: raising then would interrupt the writing of the models, summary and
plots, which is all that is left to do.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any


class StopRequest:
    """``with StopRequest(say) as stop: ... stop.requested() ...``"""

    def __init__(self, say: Callable[[str], None] = print, asynchronous: bool = False) -> None:
        self.say = say
        self.asynchronous = asynchronous  # no rounds: the server loop stops at its next check (within a second)
        self.signal_name: str | None = None
        self.stopping = False  # the run is ending and writing what it saved: no signal interrupts that
        self._previous: dict[int, Any] = {}

    def requested(self) -> bool:
        """Asked by the round loop between rounds; once it has answered True the loop stops."""
        if self.signal_name is not None:
            self.stopping = True
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            first = ("stopping at the server's next check (an asynchronous run has no rounds; uploads in flight are not waited for)"
                     if self.asynchronous else "finishing the current round")
            self.say(f"{name}: {first}, then writing models, summary and plots "
                     f"({'Ctrl-C' if signum == signal.SIGINT else 'the signal'} again stops at once)")
            return
        if self.stopping:
            self.say(f"{name}: already stopping, writing models, summary and plots")
            return
        self.stopping = True
        raise KeyboardInterrupt(name)  # the second signal mid-round: stop now

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
