"""A second Ctrl-C (or SIGTERM) stops a run at once, mid-round, and what the finished rounds saved
is still written; once the run is writing, further signals do not interrupt the writing."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from edgefl.interrupt import StopRequest
from tests.test_cli import EDGEFL, ROOT


def test_the_second_signal_mid_round_raises_and_a_third_does_not():
    said: list[str] = []
    stop = StopRequest(said.append)
    stop._handle(signal.SIGTERM, None)
    assert stop.signal_name == "SIGTERM" and "finishing the current round" in said[-1]
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGTERM, None)  # the round loop has not looked yet: stop now
    stop._handle(signal.SIGINT, None)  # the run is writing what it saved: not interrupted again
    assert "already stopping" in said[-1]


def test_a_second_signal_after_the_loop_stopped_does_not_interrupt_the_writing():
    said: list[str] = []
    stop = StopRequest(said.append)
    assert not stop.requested()
    stop._handle(signal.SIGINT, None)
    assert stop.requested()  # the round loop read it between rounds: it stops and writes
    stop._handle(signal.SIGINT, None)
    assert "already stopping" in said[-1]


def test_sigterm_twice_during_a_long_round_exits_130_with_the_summary(tmp_path: Path):
    out = tmp_path / "run"
    # a round of 1000 local epochs takes minutes: only the second signal can end it soon
    proc = subprocess.Popen([EDGEFL, "simulate", str(ROOT / "examples" / "fedhe_digits_quick.toml"), "--set", "rounds=1000",
                             "--set", "train.epochs=1000", "--out", str(out), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "run.json").is_file() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert (out / "run.json").is_file(), proc.stderr.read() if proc.poll() is not None else "no run.json"
        time.sleep(3)  # inside round 1's training
        proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        second = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
        waited = time.monotonic() - second
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-2000:]
    assert waited < 60, f"{waited:.0f} s after the second SIGTERM"
    assert "interrupted (SIGTERM) after 0 of 1000 rounds" in stderr and "Traceback" not in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["rounds_played"] == 0


def test_an_asynchronous_run_is_not_told_it_finishes_a_round():
    said: list[str] = []
    StopRequest(said.append, asynchronous=True)._handle(signal.SIGINT, None)
    assert "round" not in said[-1].replace("no rounds", "") and "stopping at the server's next check" in said[-1]
