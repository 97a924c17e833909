"""A refusal shows once on a fleet console: the server logs each refusal (for library users and
simulations, which have no event printer) and the CLI's printer shows it as an event line; while
the printer runs, the log's copy is dropped (an outside trial saw every refusal twice). A simulation
prints the server's line, not the device's copy."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from edgefl.cli import _events_printed_not_logged, _fleet_printer
from edgefl.config import NetworkSettings
from edgefl.methods import METHODS
from edgefl.server.endpoint import ServerEndpoint
from edgefl.transport.memory import MemoryServerTransport, hub
from edgefl.transport.topics import Topics


def _endpoint(name: str, on_event) -> ServerEndpoint:
    topics = Topics(name)
    return ServerEndpoint(NetworkSettings(), METHODS["fedavg"], MemoryServerTransport(hub(name), topics), ["client-0"], name,
                          num_classes=10, max_epochs=1, partial_max_age_s=60, on_event=on_event)


def test_a_refusal_is_logged_for_library_users(caplog):
    endpoint = _endpoint("refusal-logged", lambda kind, info: None)
    with caplog.at_level(logging.WARNING, logger="edgefl.server"):
        endpoint.count("client-0", "tensor 'w' holds a NaN")
    assert [r.getMessage() for r in caplog.records] == ["rejected from client-0: tensor 'w' holds a NaN"]


def test_the_fleet_console_prints_a_refusal_once_and_keeps_other_warnings(caplog):
    buffer = io.StringIO()
    endpoint = _endpoint("refusal-once", _fleet_printer(Console(file=buffer, width=500, color_system=None), 3, None, 1))
    with caplog.at_level(logging.WARNING, logger="edgefl.server"), _events_printed_not_logged():
        endpoint.count("client-0", "tensor 'w' holds a NaN")
        logging.getLogger("edgefl.server").warning("something else")
    printed = [line for line in buffer.getvalue().splitlines() if "holds a NaN" in line]
    assert len(printed) == 1 and "client-0" in printed[0], printed  # the event line, naming the device
    assert [r.getMessage() for r in caplog.records] == ["something else"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgefl.server"):  # (another test may have raised the logger's level)
        endpoint.count("client-0", "second refusal")  # the console is gone: the log has it again
    assert [r.getMessage() for r in caplog.records] == ["rejected from client-0: second refusal"]


def test_a_device_restarted_from_scratch_is_said_once_and_whole():
    """The server's warning about a device that lost its state (an outside trial saw it twice, the
    second copy cut short): once, as the event line, with its reason whole."""
    from edgefl.messages import Message

    buffer = io.StringIO()
    endpoint = _endpoint("restart-once", _fleet_printer(Console(file=buffer, width=2000, color_system=None), 3, None, 1))
    lost = "the state saved after round 18 cannot be read (carry.safetensors: Error while deserializing header: invalid header length)"
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    server_log = logging.getLogger("edgefl.server")
    server_log.addHandler(handler)
    try:
        with _events_printed_not_logged():
            endpoint._note_start("client-0", Message("weights", 1, "client-0", {}, {"started_from": "scratch"}))
            endpoint._note_start("client-0", Message("weights", 19, "client-0", {}, {"started_from": "scratch", "state_lost": lost}))
    finally:
        server_log.removeHandler(handler)
    printed = buffer.getvalue()
    assert printed.count("restarted from scratch in round 19 after taking part from round 1") == 1
    assert lost in printed and "catches up" in printed  # not cut short
    assert not [r for r in records if "restarted from scratch" in r.getMessage()]


def test_an_asynchronous_record_is_printed_as_updates_with_who_reported():
    """An outside trial read 'round 3 async: 1/0 reported' (an asynchronous run selects nobody): the
    line says updates, the reports and their devices, and local DP's epsilon as a round's line does."""
    buffer = io.StringIO()
    printer = _fleet_printer(Console(file=buffer, width=500, color_system=None), 12, None, 3)
    printer("closed", {"round": 3, "mode": "async", "outcome": "async", "reports": 3, "reports_per_client": {"client-0": 2, "client-2": 1},
                       "selected": [], "reported": ["client-0", "client-2"], "missing": [], "accuracy": {"overall": 0.5},
                       "round_time_s": 1.25, "filters": {"local-dp": {"epsilon_max": 5.4, "delta": 1e-5}}})
    line = buffer.getvalue().strip()
    assert line == "update 3/12: 3 reports from 2 devices (client-0, client-2), acc 0.5000, 1.2s, local-dp epsilon 5.4 (delta 1e-05)", line


MISSHAPEN = """
import torch
from edgefl.algorithms.fedavg import FedAvgClient
from edgefl.methods import MethodSpec, register_method


class MisshapenClient(FedAvgClient):
    \"\"\"FedAvg, but client-1 uploads one tensor in the wrong shape (the server refuses it).\"\"\"

    def fit(self, downlink, round_no):
        reply = super().fit(downlink, round_no)
        if self.client_id == "client-1":
            reply.tensors[next(iter(reply.tensors))] = torch.zeros(3, 3)
        return reply


register_method(MethodSpec("misshapen", "fedavg with a misshapen upload", "misshapen:MisshapenClient",
                           "edgefl.server.methods.fedavg:FedAvgServer", "edgefl.algorithms.fedavg:FedAvgOptions",
                           uploads=("weights",), downloads=("weights",)))
"""


def _simulate_misshapen(tmp_path: Path, plugin: str) -> subprocess.CompletedProcess:
    (tmp_path / "misshapen.py").write_text(plugin)
    (tmp_path / "run.toml").write_text('''name = "misshapen"
seed = 0
rounds = 2
[method]
name = "misshapen"
[data]
dataset = "digits"
[fleet]
groups = [ { model = "mlp", count = 3, options = { hidden = [16] } } ]
''')
    env = {k: v for k, v in os.environ.items() if k != "EDGEFL_PLUGINS"}
    env["EDGEFL_PLUGINS"] = str(tmp_path / "misshapen.py")
    done = subprocess.run([sys.executable, "-m", "edgefl", "simulate", "run.toml", "--out", "run", "--quiet"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    return done


def test_a_simulation_prints_a_refusal_once(tmp_path):
    """The server's "rejected from" line and the device's "upload refused" told one refusal twice
    on a simulation's console (both halves log to it): the server's line stays, naming the device."""
    done = _simulate_misshapen(tmp_path, MISSHAPEN)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert said.count("rejected from client-1:") == 2, said  # one a round
    assert "upload refused" not in said, said
    from edgefl.sim.engine import round_line

    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "(1 refused)" in round_line(record, 2)


def test_a_round_whose_uploads_were_all_refused_says_so_in_its_receipts_and_tables(tmp_path):
    """Each refused device's receipt said "missing: no upload by the deadline" and the accuracy
    table was an empty frame: the receipts give the refusal, the table says nothing was evaluated."""
    done = _simulate_misshapen(tmp_path, MISSHAPEN.replace('if self.client_id == "client-1":', "if True:"))
    said = done.stdout + done.stderr
    assert done.returncode == 3, said  # failed rounds
    assert "no round was evaluated" in said, said
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["outcome"] == "failed"
    assert first["failure"].startswith("no quorum by the deadline (0 of 2 needed reported, 3 selected; 3 upload(s) refused"), first
    assert all(r.startswith("refused: extractor.1.weight: (3, 3)") for r in first["receipts"].values()), first["receipts"]
    from edgefl.sim.engine import round_line

    assert " up 0 B (3 refused) " in round_line(first, 2)  # the bytes count accepted uploads only: "up 0 B" alone hid why


def test_a_decline_is_printed_whole():
    """The fleet console cut a device's decline at 300 characters, mid-word: the server keeps 500, all printed."""
    buffer = io.StringIO()
    printer = _fleet_printer(Console(file=buffer, width=2000, color_system=None), 3, None, 1)
    reason = "the server's task cannot be served by this device: " + "unknown method 'fedprox' " * 17
    printer("declined", {"device": "client-0", "reason": reason[:500]})
    assert reason[:500] in buffer.getvalue() and "..." not in buffer.getvalue()
