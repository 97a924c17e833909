"""Stages and filters, registered from this file alone: a filter that halves every float it
uploads (and doubles it back on the server: exact in binary floating point, so the run's numbers
must not move) and a filter that brings a stage (``echo``: the server sends each device a number,
the device sends it back). They run in a simulation and as a fleet over a real mosquitto (server
and devices in this process, so the registrations reach them) with the same records; devices
that do not answer a stage drop out of the round, and a stage below its quorum fails it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import tomli_w
import torch

from edgefl.config import RunConfig, validate_config
from edgefl.errors import ConfigError, PayloadError
from edgefl.filters import FILTERS, Filter, FilterOptions, register_filter
from edgefl.messages import Message
from edgefl.rundir import RunDir
from edgefl.stages import Stage
from tests.conftest import digits_config
from tests.test_every_method import _records


class HalveOptions(FilterOptions):
    factor: float = 0.5


@register_filter
class Halve(Filter):
    """Uploads leave the device multiplied by ``factor`` and are divided back on the server."""

    name = "test-halve"
    Options = HalveOptions
    seen_by_server = 0

    def upload_out(self, message: Message) -> Message:
        tensors = {k: t * self.options.factor if t.is_floating_point() else t for k, t in message.tensors.items()}
        return Message(message.kind, message.round, message.sender, tensors, {**message.meta, "halved": True}, message.message_id)

    def upload_in(self, message: Message) -> Message:
        if message.tensors and message.meta.get("halved") is not True:
            raise PayloadError("test-halve: an upload that was not halved")
        Halve.seen_by_server += 1
        tensors = {k: t / self.options.factor if t.is_floating_point() else t for k, t in message.tensors.items()}
        meta = {k: v for k, v in message.meta.items() if k != "halved"}
        return Message(message.kind, message.round, message.sender, tensors, meta, message.message_id)


class EchoOptions(FilterOptions):
    silent: list[str] = []  # devices that never answer (to test dropouts)
    quorum: float = 0.5
    deadline_s: float = 20.0  # how long a fleet waits for the silent ones


class EchoStage(Stage):
    name = "echo"
    when = "before"
    def __init__(self, quorum: float, deadline_s: float) -> None:
        self.quorum = quorum
        self.deadline_s = deadline_s
        self.closed: list[tuple[int, list[str], list[str]]] = []

    def nonce(self, round_no: int, device: str) -> int:
        return round_no * 1000 + int(device.rsplit("-", 1)[-1])

    def request(self, round_no: int, device: str, participants: list[str]) -> Message:
        return Message("stage", round_no, "server", {"nonce": torch.tensor([self.nonce(round_no, device)])}, {"stage": self.name})

    def check(self, round_no: int, device: str, reply: Message) -> str | None:
        got = reply.tensors.get("nonce")
        if got is None or got.dtype != torch.int64 or got.tolist() != [self.nonce(round_no, device)]:
            return "echo: the reply does not carry the nonce it was sent"
        return None

    def close(self, round_no: int, replies: dict[str, Message], dropped: list[str]) -> None:
        self.closed.append((round_no, sorted(replies), sorted(dropped)))


@register_filter
class Echo(Filter):
    name = "test-echo"
    Options = EchoOptions

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stage = EchoStage(self.options.quorum, self.options.deadline_s)

    def server_stages(self) -> list[Stage]:
        return [self.stage]

    def answer_stage(self, stage: str, request: Message) -> Message | None:
        if stage != "echo" or self.device in self.options.silent:
            return None
        return Message("stage", request.round, self.device or "?", {"nonce": request.tensors["nonce"].clone()}, {})


class NeedsWeightsOptions(FilterOptions):
    pass


@register_filter
class NeedsWeights(Filter):
    name = "test-needs-weights"
    Options = NeedsWeightsOptions

    @classmethod
    def refusal(cls, options, spec, **run) -> str | None:
        return None if "weights" in spec.uploads else f"{spec.name} uploads {', '.join(spec.uploads)}, not weights"


def _config(method: str = "fedavg", filters: list[dict] | None = None, rounds: int = 2, mlps_only: bool = False, **network) -> RunConfig:
    raw = digits_config(method, rounds=rounds)
    if mlps_only:  # no dropout: devices that train in threads of one process draw from no shared generator
        raw["fleet"] = {"groups": [{"model": "mlp", "count": 2, "options": {"hidden": [32, 16]}},
                                   {"model": "mlp", "count": 2, "options": {"hidden": [24]}}]}
    raw["threads"] = 1
    raw["network"] = {"federation": f"stages-{method}", "round_deadline_s": 60, **network}
    if filters is not None:
        raw["filters"] = filters
    return validate_config(raw)


def _strip(records: list[dict]) -> list[dict]:
    """Records without what the filters add: the stage's account, and the upload bytes (the
    halving filter's flag makes each upload's header a few bytes longer)."""
    return [{k: v for k, v in r.items() if k not in ("stages", "bytes_up", "bytes_up_per_client")} for r in records]


def test_filters_and_a_stage_leave_a_simulation_s_numbers_unchanged_and_are_recorded(tmp_path):
    from edgefl.sim import Simulation

    plain = _config()
    filtered = _config(filters=[{"name": "test-halve"}, {"name": "test-echo"}])
    Simulation(plain, RunDir.create(tmp_path / "plain", plain.name, plain.seed), show_progress=False).run()
    before = Halve.seen_by_server
    sim = Simulation(filtered, RunDir.create(tmp_path / "filtered", filtered.name, filtered.seed), show_progress=False)
    sim.run()
    assert Halve.seen_by_server - before == 2 * 4  # every upload of both rounds passed the server side
    plain_records, records = _records(tmp_path / "plain"), _records(tmp_path / "filtered")
    assert _strip(records) == _strip(plain_records)
    assert all(0 < r["bytes_up"] - p["bytes_up"] <= 4 * 32 for r, p in zip(records, plain_records))
    assert [r["stages"] for r in records] == [{"echo": {"asked": 4, "answered": 4, "dropped": []}}] * 2
    run = json.loads((tmp_path / "filtered" / "run.json").read_text())
    assert run["filters"] == [{"name": "test-halve", "factor": 0.5}, {"name": "test-echo", "silent": [], "quorum": 0.5, "deadline_s": 20.0}]
    assert "filters" not in json.loads((tmp_path / "plain" / "run.json").read_text())
    (config,) = [p for p in (tmp_path / "filtered").glob("config.toml")]
    assert "test-halve" in config.read_text()  # config.toml keeps the chain: the run can be replayed


def test_a_device_that_does_not_answer_a_stage_drops_out_and_the_round_goes_on():
    from edgefl.sim import Simulation

    cfg = _config(filters=[{"name": "test-echo", "silent": ["client-1"]}], rounds=1)
    sim = Simulation(cfg, show_progress=False)
    record = sim.run_round(1)
    assert record["outcome"] == "complete"
    assert record["stages"]["echo"] == {"asked": 4, "answered": 3, "dropped": ["client-1"]}
    assert record["receipts"]["client-1"] == "dropped: no answer in stage echo"
    assert "client-1" not in record["reported"] and sorted(record["reported"]) == ["client-0", "client-2", "client-3"]
    assert record["bytes_down_per_client"].get("client-1") is None  # no download for a device that dropped out


def test_a_stage_below_its_quorum_fails_the_round_with_the_reason():
    from edgefl.sim import Simulation

    cfg = _config(filters=[{"name": "test-echo", "silent": ["client-1", "client-2"], "quorum": 0.75}], rounds=1)
    record = Simulation(cfg, show_progress=False).run_round(1)
    assert record["outcome"] == "failed"
    assert record["failure"] == "stage echo: 2 of 4 devices answered, 3 needed"
    assert record["reported"] == []


def test_a_stage_reply_that_fails_the_stage_check_is_refused_and_the_device_drops_out(monkeypatch):
    from edgefl.sim import Simulation

    cfg = _config(filters=[{"name": "test-echo"}], rounds=1)
    sim = Simulation(cfg, show_progress=False)
    real = Echo.answer_stage

    def lying(self, stage, request):
        reply = real(self, stage, request)
        if self.device == "client-3" and reply is not None:
            reply.tensors["nonce"] = reply.tensors["nonce"] + 1
        return reply

    monkeypatch.setattr(Echo, "answer_stage", lying)
    record = sim.run_round(1)
    assert record["stages"]["echo"]["dropped"] == ["client-3"]
    assert any("does not carry the nonce" in reason for reason in record["rejected"]["by_reason"])


def test_the_same_filters_and_stage_run_the_same_in_a_fleet(tmp_path):
    """Server and devices in this process (threads) over a real mosquitto: the registrations of
    this file reach both sides."""
    from edgefl.fleet.launcher import run_device, serve
    from edgefl.sim import Simulation
    from tests.mosquitto import mosquitto

    # client-2 never answers the stage: each round waits the stage's deadline for it, in seconds of wall time
    cfg = _config(filters=[{"name": "test-halve"}, {"name": "test-echo", "silent": ["client-2"], "deadline_s": 5.0}], mlps_only=True)
    Simulation(cfg, RunDir.create(tmp_path / "sim", cfg.name, cfg.seed), show_progress=False).run()
    with mosquitto(tmp_path) as broker:
        results: dict = {}
        server = threading.Thread(target=lambda: results.update(
            summary=serve(cfg, broker, RunDir.create(tmp_path / "fleet", cfg.name, cfg.seed), join_timeout_s=60)), daemon=True)
        server.start()
        devices = [threading.Thread(target=run_device, args=(cfg, f"client-{i}", broker), kwargs={"timeout_s": 120}, daemon=True)
                   for i in range(4)]
        for d in devices:
            d.start()
        server.join(240)
        for d in devices:
            d.join(30)
    assert "summary" in results
    sim_records, fleet_records = _records(tmp_path / "sim"), _records(tmp_path / "fleet")
    assert fleet_records == sim_records
    assert sim_records[0]["stages"]["echo"]["dropped"] == ["client-2"]


def test_a_filter_that_cannot_serve_the_method_is_refused_before_anything_is_created(tmp_path):
    with pytest.raises(ConfigError, match="test-needs-weights.*fedhe uploads class_logits, not weights"):
        _config("fedhe", filters=[{"name": "test-needs-weights"}])
    _config("fedavg", filters=[{"name": "test-needs-weights"}])  # FedAvg uploads weights: fine
    # the command line: a built-in filter that cannot serve FedHe, refused before a run directory exists
    raw = digits_config("fedhe", rounds=1)
    raw["filters"] = [{"name": "topk"}]
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(raw))
    done = subprocess.run([sys.executable, "-m", "edgefl", "simulate", str(path), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "per-class logits, not weights" in done.stdout + done.stderr, done.stdout + done.stderr
    assert not (tmp_path / "out").exists()


def test_filter_names_and_options_are_checked_with_did_you_mean():
    with pytest.raises(ConfigError, match="did you mean 'test-halve'"):
        _config(filters=[{"name": "test-halv"}])
    with pytest.raises(ConfigError, match="factr") as caught:
        _config(filters=[{"name": "test-halve", "factr": 2}])
    assert "factor" in caught.value.hint
    with pytest.raises(ConfigError, match="factor"):
        _config(filters=[{"name": "test-halve", "factor": "big"}])


def test_a_device_held_task_carries_the_chain_and_a_device_refuses_one_it_does_not_know():
    from edgefl.task import parse_task

    cfg = _config(filters=[{"name": "test-halve", "factor": 0.25}])
    from edgefl.build import build_run
    from edgefl.server.enrolment import task_for

    parts = build_run(cfg)
    task = task_for(cfg, parts, parts.slots[0], "run-1", "fed")
    info = task.to_info()
    assert info["filters"] == [{"name": "test-halve", "options": {"factor": 0.25}}]
    assert parse_task(info).filter_chain() == [("test-halve", {"factor": 0.25})]
    with pytest.raises(PayloadError, match="cannot be served by this device: no filter 'test-halvee'.*did you mean") as caught:
        parse_task({**info, "filters": [{"name": "test-halvee", "options": {}}]})
    assert "plug-in" in str(caught.value) and "(top level)" not in str(caught.value)
    plain = task_for(_config(), parts, parts.slots[0], "run-1", "fed").to_info()
    assert "filters" not in plain  # a run without filters sends the task earlier devices know


def test_an_asynchronous_run_refuses_a_stage_with_the_reason():
    raw = digits_config("fedhe", rounds=2)
    raw["mode"] = "async"
    raw["filters"] = [{"name": "test-echo"}]
    from edgefl.sim import Simulation

    with pytest.raises(ConfigError, match="stages \\(echo\\) run within a round"):
        Simulation(validate_config(raw), show_progress=False)


def test_the_registry_knows_the_test_filters():
    assert {"test-halve", "test-echo", "test-needs-weights"} <= set(FILTERS)


def test_edgefl_filters_lists_every_registered_filter_with_its_options():
    from typer.testing import CliRunner

    from edgefl.cli import app

    result = CliRunner().invoke(app, ["filters"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in ("quantize", "topk", "test-halve", "test-echo"):
        assert name in result.output
    assert "factor (0.5)" in result.output and "[[filters]]" in result.output
