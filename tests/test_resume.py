"""Long runs survive being stopped (issue 38): a simulation checkpoints the server's state and
every device's (models, what methods and filters carry, the virtual clock) every
``simulation.checkpoint_every`` rounds and when it is stopped, and `edgefl simulate --resume`
goes on from there with the records an uninterrupted run writes: after a stop between rounds,
and after a crash past the last checkpoint (the rounds recorded since are played again)."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from edgefl.config import RunConfig
from edgefl.errors import ConfigError
from edgefl.rundir import RunDir
from edgefl.sim import Simulation
from tests.conftest import method_config
from tests.test_every_method import _records


def _config(method: str, filters: list | None = None, rounds: int = 4, every: int = 2) -> RunConfig:
    raw = method_config(method, rounds=rounds)
    raw["threads"] = 1
    raw.setdefault("simulation", {})["checkpoint_every"] = every
    if filters:
        raw["filters"] = filters
    return RunConfig.model_validate(raw)


CASES = {
    "fedavg": ("fedavg", None),
    "fedhe": ("fedhe", None),
    "fedin": ("fedin", None),
    "felo": ("felo", None),
    "velo": ("velo", None),
    "chfl": ("chfl", None),
    # filters that carry state: top-k's residual on the device, DP-FedAvg's releases on the server
    "fedavg+topk+dp": ("fedavg", [{"name": "topk", "fraction": 0.2}, {"name": "dp-fedavg", "clip": 5.0, "noise_multiplier": 0.3}]),
    "fedhe+local-dp": ("fedhe", [{"name": "local-dp", "noise_multiplier": 0.5}]),
}


def stopped_and_resumed(cfg: RunConfig, tmp_path, stop_after: int = 3, resume_with: RunConfig | None = None,
                        on_resume=None) -> tuple:
    """Run ``cfg`` whole, and again stopped after ``stop_after`` records and resumed (with
    ``resume_with``, when given; ``on_resume(sim)`` sees the resumed simulation before it goes on);
    the two run directories' paths."""
    whole = RunDir.create(tmp_path / "whole", cfg.name, cfg.seed)
    Simulation(cfg, whole, show_progress=False).run()
    stopped = RunDir.create(tmp_path / "stopped", cfg.name, cfg.seed)
    played: list[int] = []
    assert Simulation(cfg, stopped, show_progress=False, on_round=lambda r: played.append(r["round"])).run(
        should_stop=lambda: len(played) >= stop_after)["interrupted"]
    again = Simulation(resume_with or cfg, RunDir(stopped.path), show_progress=False)
    again.resume()
    if on_resume is not None:
        on_resume(again)
    again.run()
    return whole.path, stopped.path


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_stopped_and_resumed_run_writes_what_an_uninterrupted_one_writes(case, tmp_path):
    method, filters = CASES[case]
    cfg = _config(method, filters)
    whole = RunDir.create(tmp_path / "whole", cfg.name, cfg.seed)
    Simulation(cfg, whole, show_progress=False).run()

    # stopped after round 3 (a Ctrl-C between rounds): the stop writes a checkpoint at round 3
    stopped = RunDir.create(tmp_path / "stopped", cfg.name, cfg.seed)
    played: list[int] = []
    first = Simulation(cfg, stopped, show_progress=False, on_round=lambda r: played.append(r["round"]))
    assert first.run(should_stop=lambda: len(played) >= 3)["interrupted"]
    again = Simulation(cfg, RunDir(stopped.path), show_progress=False)
    assert again.resume() == 4
    again.run()
    assert _records(stopped.path) == _records(whole.path)


def test_a_crash_past_the_last_checkpoint_plays_those_rounds_again(tmp_path, monkeypatch):
    from edgefl.server.rounds import SyncRounds

    cfg = _config("fedhe", rounds=5, every=2)
    whole = RunDir.create(tmp_path / "whole", cfg.name, cfg.seed)
    Simulation(cfg, whole, show_progress=False).run()
    crashed = RunDir.create(tmp_path / "crashed", cfg.name, cfg.seed)
    real = SyncRounds.run_round

    def crash_in_round_4(self, r):
        if r == 4:
            raise RuntimeError("the machine went away")
        return real(self, r)

    monkeypatch.setattr(SyncRounds, "run_round", crash_in_round_4)
    with pytest.raises(RuntimeError):
        Simulation(cfg, crashed, show_progress=False).run()
    assert [r["round"] for r in _records(crashed.path)] == [1, 2, 3]  # the checkpoint is after round 2
    monkeypatch.setattr(SyncRounds, "run_round", real)
    import json

    def elapsed() -> list[float]:
        return [json.loads(line)["elapsed_s"] for line in (crashed.path / "metrics.jsonl").read_text().splitlines()]

    first_sitting = elapsed()[1]  # after round 2, the round the checkpoint keeps
    time.sleep(0.3)  # between the sittings: not the run's time
    t_resume = time.monotonic()
    again = Simulation(cfg, RunDir(crashed.path), show_progress=False)
    assert again.resume() == 3
    again.run()
    assert _records(crashed.path) == _records(whole.path)
    # the run's time goes on from the earlier sitting's (the rounds it kept), not from zero
    times = elapsed()
    assert times == sorted(times) and times[2] > first_sitting
    wall = json.loads((crashed.path / "summary.json").read_text())["wall_time_s"]
    assert first_sitting < wall < first_sitting + (time.monotonic() - t_resume) + 1


def _config_file(folder, cfg: RunConfig):
    path = folder / "run.toml"
    path.write_text(cfg.to_toml())
    return path


def test_the_command_line_resumes_from_the_run_directory_alone(tmp_path):
    from edgefl.cli import app

    cfg = _config("fedavg", rounds=3, every=1)
    path = _config_file(tmp_path, cfg)
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["simulate", str(path), "--out", str(out), "--quiet", "--set", "rounds=2"])
    assert res.exit_code == 0, res.output
    # the same directory with another config (3 rounds) is refused; its own config resumes (nothing left to play)
    res = CliRunner().invoke(app, ["simulate", str(path), "--out", str(out), "--resume", "--quiet"])
    assert isinstance(res.exception, ConfigError) and "belongs to another config" in str(res.exception)
    assert "3 rounds" not in res.output  # no header with the refused config's numbers before the refusal
    res = CliRunner().invoke(app, ["simulate", "--out", str(out), "--resume", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "nothing left to resume" in res.output
    assert [r["round"] for r in _records(out)] == [1, 2]


def test_resuming_a_finished_sync_run_says_it_had_finished_when_it_plays_rounds_again(tmp_path):
    """The last checkpoint of a finished run can come before its last round (checkpoint_every=2 of
    3 rounds): resuming plays round 3 again with the same numbers, and says why."""
    from edgefl.cli import app

    cfg = _config("fedavg", rounds=3, every=2)
    path = _config_file(tmp_path, cfg)
    out = tmp_path / "run"
    assert CliRunner().invoke(app, ["simulate", str(path), "--out", str(out), "--quiet"]).exit_code == 0
    before = _records(out)
    res = CliRunner().invoke(app, ["simulate", "--out", str(out), "--resume", "--quiet"])
    assert res.exit_code == 0, res.output
    assert ("this run had finished; resuming at round 3 of 3 (the checkpoint after round 2; the 1 record written after it is "
            "played again, with the same numbers)") in " ".join(res.output.split())
    assert _records(out) == before


def test_a_run_that_ended_before_its_first_checkpoint_says_why_there_is_nothing_to_resume(tmp_path):
    from edgefl.cli import app

    cfg = _config("fedavg", rounds=2, every=3)
    path = _config_file(tmp_path, cfg)
    out = tmp_path / "run"
    assert CliRunner().invoke(app, ["simulate", str(path), "--out", str(out), "--quiet"]).exit_code == 0
    res = CliRunner().invoke(app, ["simulate", "--out", str(out), "--resume", "--quiet"])
    assert isinstance(res.exception, ConfigError)
    text = " ".join(f"{res.exception} {res.exception.hint}".split())
    assert "this run finished after 2 records without a checkpoint (it checkpointed every 3 rounds" in text
    assert "results stay as they are" in text and "another --out" in text
    # the interval said is the run's own (its config.toml), not the one the resuming command gives
    with pytest.raises(ConfigError, match="checkpointed every 3 rounds"):
        Simulation(_config("fedavg", rounds=2, every=5), RunDir(out), show_progress=False).resume()
    (out / "summary.json").unlink()  # as after a crash: rounds recorded, no summary, no checkpoint
    res = CliRunner().invoke(app, ["simulate", "--out", str(out), "--resume", "--quiet"])
    text = " ".join(f"{res.exception} {res.exception.hint}".split())
    assert "stopped after 2 records, before its first checkpoint" in text and "a lower simulation.checkpoint_every" in text


def test_what_cannot_be_resumed_is_refused_with_the_reason(tmp_path):
    cfg = _config("fedavg", every=0)
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    with pytest.raises(ConfigError, match="checkpoint_every is 0"):
        Simulation(cfg, run, show_progress=False).resume()
    cfg = _config("fedavg")
    with pytest.raises(ConfigError, match="nothing to resume"):
        Simulation(cfg, RunDir.create(tmp_path / "empty", cfg.name, cfg.seed), show_progress=False).resume()


def test_a_kept_optimizer_goes_on_across_rounds_and_survives_a_resume(tmp_path):
    """train.optimizer_state = "kept" (the FedHe authors' code): one Adam per device for the whole
    run; its moments and step count are part of the device's state, so a stopped run resumes with
    the numbers of an uninterrupted one, and they differ from a run with a new optimizer each round."""
    raw = method_config("fedhe", rounds=4)
    raw["threads"] = 1
    raw["train"]["optimizer_state"] = "kept"
    raw.setdefault("simulation", {})["checkpoint_every"] = 2
    kept = RunConfig.model_validate(raw)
    whole = RunDir.create(tmp_path / "whole", kept.name, kept.seed)
    sim = Simulation(kept, whole, show_progress=False)
    sim.run()
    adam = sim.clients["client-0"].kept_optimizer()
    assert int(adam.state_dict()["state"][0]["step"]) > sim.clients["client-0"].last_train_samples // raw["train"]["batch_size"]
    stopped = RunDir.create(tmp_path / "stopped", kept.name, kept.seed)
    played: list[int] = []
    Simulation(kept, stopped, show_progress=False, on_round=lambda r: played.append(r["round"])).run(should_stop=lambda: len(played) >= 3)
    again = Simulation(kept, RunDir(stopped.path), show_progress=False)
    assert again.resume() == 4
    again.run()
    assert _records(stopped.path) == _records(whole.path)
    raw["train"]["optimizer_state"] = "per_round"
    fresh = RunDir.create(tmp_path / "fresh", kept.name, kept.seed)
    Simulation(RunConfig.model_validate(raw), fresh, show_progress=False).run()
    assert _records(fresh.path)[-1]["train_loss"] != _records(whole.path)[-1]["train_loss"]


def test_a_changed_config_is_refused_naming_what_changed(tmp_path):
    cfg = _config("fedavg", rounds=2, every=1)
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    Simulation(cfg, run, show_progress=False).run()
    longer = _config("fedavg", rounds=3, every=1)
    live = (run.path / "live.json").read_text()
    longer.simulation.checkpoint_every = 2  # the one change a resume may make is not listed as one
    with pytest.raises(ConfigError, match="rounds 2 -> 3") as exc:
        Simulation(longer, RunDir(run.path), show_progress=False).resume()
    assert "checkpoint_every" not in str(exc.value)
    assert (run.path / "live.json").read_text() == live  # the dashboard's picture of the run is left as it was



@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_resume_may_change_how_often_the_run_checkpoints(mode, tmp_path, caplog):
    """checkpoint_every changes none of the numbers: a resume may set another, says it took it, and
    config.toml then says it."""
    make = (lambda every: _config("fedhe", rounds=6, every=every)) if mode == "sync" else (lambda every: _async_config("fedhe", every=every))
    with caplog.at_level("WARNING", logger="edgefl.server"):
        whole, stopped = stopped_and_resumed(make(2), tmp_path, resume_with=make(1))
    assert _records(stopped) == _records(whole)
    assert "checkpoint_every = 1" in (stopped / "config.toml").read_text()
    assert "takes simulation.checkpoint_every = 1 (it was 2)" in caplog.text


# --- asynchronous runs: the work and messages under way are part of the checkpoint ---------------

def _async_config(method: str, rounds: int = 12, every: int = 2, filters: list | None = None, **settings) -> RunConfig:
    raw = method_config(method, rounds=rounds)
    raw.update(mode="async", threads=1, eval={"every": 2})
    raw.setdefault("simulation", {})["checkpoint_every"] = every
    if settings:
        raw["asynchronous"] = settings
    if filters:
        raw["filters"] = filters
    return RunConfig.model_validate(raw)


def _timed_fedavg() -> RunConfig:
    """Device classes on the virtual clock, records by time, a buffer of three: uploads are on their
    way at every checkpoint and a record often falls while reports wait in the buffer."""
    raw = method_config("fedavg", rounds=10_000)
    raw.update(mode="async", threads=1)
    raw["fleet"] = {"groups": [
        {"model": "mlp", "count": 2, "profile": "pi4-4gb", "options": {"hidden": [16]}},
        {"model": "mlp", "count": 2, "profile": "pi-zero-2w", "options": {"hidden": [16]}},
    ]}
    raw["asynchronous"] = {"time_budget_s": 0.12, "eval_every_s": 0.02, "buffer_size": 3}
    raw.setdefault("simulation", {})["checkpoint_every"] = 1
    return RunConfig.model_validate(raw)


ASYNC_CASES = {
    "fedhe": lambda: _async_config("fedhe"),
    "fedavg-fedbuff": lambda: _async_config("fedavg", buffer_size=3),
    "velo": lambda: _async_config("velo"),
    "fedin": lambda: _async_config("fedin", rounds=8),
    "fedhe+local-dp": lambda: _async_config("fedhe", filters=[{"name": "local-dp", "noise_multiplier": 0.5}]),
    "fedavg-timed": _timed_fedavg,
}


@pytest.mark.parametrize("case", sorted(ASYNC_CASES))
def test_an_asynchronous_run_stopped_and_resumed_writes_what_an_uninterrupted_one_writes(case, tmp_path, caplog):
    cfg = ASYNC_CASES[case]()
    whole = RunDir.create(tmp_path / "whole", cfg.name, cfg.seed)
    Simulation(cfg, whole, show_progress=False).run()
    assert len(_records(whole.path)) >= 4

    stopped = RunDir.create(tmp_path / "stopped", cfg.name, cfg.seed)
    played: list[int] = []
    first = Simulation(cfg, stopped, show_progress=False, on_round=lambda r: played.append(r["round"]))
    assert first.run(should_stop=lambda: len(played) >= 3)["interrupted"]
    again = Simulation(cfg, RunDir(stopped.path), show_progress=False)
    again.resume()
    assert len(again.history) <= 3  # the records up to the checkpoint; those after it are played again
    again.run()
    assert _records(stopped.path) == _records(whole.path)  # bytes too: a restored device is no restart from scratch
    assert "restarted from scratch" not in caplog.text


def test_an_asynchronous_run_crashed_past_its_checkpoint_plays_the_updates_since_again(tmp_path):
    cfg = _async_config("fedhe", rounds=12, every=2)
    whole = RunDir.create(tmp_path / "whole", cfg.name, cfg.seed)
    Simulation(cfg, whole, show_progress=False).run()
    crashed = RunDir.create(tmp_path / "crashed", cfg.name, cfg.seed)

    def crash_at_the_third_record(record):
        if record["round"] >= 6:
            raise RuntimeError("the machine went away")

    with pytest.raises(RuntimeError):
        Simulation(cfg, crashed, show_progress=False, on_round=crash_at_the_third_record).run()
    assert len(_records(crashed.path)) == 3  # the third record was written, the checkpoint is after the second
    again = Simulation(cfg, RunDir(crashed.path), show_progress=False)
    assert again.resume() == 5 and len(again.history) == 2
    again.run()
    assert _records(crashed.path) == _records(whole.path)


def test_the_command_line_resumes_an_asynchronous_run(tmp_path):
    from edgefl.cli import app
    from edgefl.interrupt import StopRequest

    cfg = _async_config("fedhe", rounds=8, every=1)
    path = _config_file(tmp_path, cfg)
    whole = tmp_path / "whole"
    assert CliRunner().invoke(app, ["simulate", str(path), "--out", str(whole), "--quiet"]).exit_code == 0
    out = tmp_path / "run"
    real = StopRequest.requested

    def stop_after_a_while(self):  # as a Ctrl-C after the second record would
        metrics = out / "metrics.jsonl"
        return (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2) or real(self)

    StopRequest.requested = stop_after_a_while
    try:
        res = CliRunner().invoke(app, ["simulate", str(path), "--out", str(out), "--quiet"])
    finally:
        StopRequest.requested = real
    assert res.exit_code == 130, res.output
    assert "edgefl simulate --resume --out" in res.output and "of 8 server updates" in res.output
    at_the_stop = "checkpointed at the stop" in " ".join(res.output.split())
    res = CliRunner().invoke(app, ["simulate", "--out", str(out), "--resume", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "resuming after server update" in res.output and "this run had finished" not in res.output
    assert ("played again" in res.output) != at_the_stop  # a replay is announced only when the stop kept no checkpoint
    assert _records(out) == _records(whole)
    res = CliRunner().invoke(app, ["simulate", "--out", str(out), "--resume", "--quiet"])  # once more: it had finished
    assert res.exit_code == 0 and "this run had finished" in res.output
    assert _records(out) == _records(whole)


def test_an_asynchronous_fleet_server_refuses_to_resume_and_says_what_can(tmp_path):
    from edgefl.build import build_run
    from edgefl.server.session import RunSession

    cfg = _async_config("fedhe")
    session = RunSession(build_run(cfg), None, "f", runner="fleet", run_dir=RunDir(tmp_path), deadline_s=10)
    with pytest.raises(ConfigError, match="asynchronous fleet server cannot be resumed.*edgefl simulate --resume"):
        session.resume()


def test_a_damaged_asynchronous_checkpoint_is_refused_with_what_to_do(tmp_path):
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    cfg = _async_config("fedhe", rounds=8, every=1)
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    played: list[int] = []
    Simulation(cfg, run, show_progress=False, on_round=lambda r: played.append(r["round"])).run(should_stop=lambda: len(played) >= 2)
    state = run.path / "server-state.safetensors"
    with safe_open(str(state), framework="pt") as f:
        meta = json.loads(f.metadata()["edgefl"])
    del meta["carried"]["__dict__"][0]  # one of the policy's fields gone
    save_file(load_file(str(state)), str(state), metadata={"edgefl": json.dumps(meta)})
    with pytest.raises(ConfigError, match="asynchronous part cannot be read") as caught:
        Simulation(cfg, RunDir(run.path), show_progress=False).resume()
    assert "start the run again" in caught.value.hint


def test_the_run_s_refusal_count_goes_on_from_the_checkpoint(tmp_path):
    """Stale reports refused before the stop still count in the resumed run's summary."""
    import json

    cfg = _async_config("fedhe", rounds=12, every=2, staleness_bound=1)
    counted_before: list[int] = []
    whole, stopped = stopped_and_resumed(cfg, tmp_path, on_resume=lambda sim: counted_before.append(sim.session.endpoint.rejections.total))
    assert counted_before[0] > 0  # refused before the checkpoint

    def refusals(path):
        return json.loads((path / "summary.json").read_text())["rejections"]

    assert refusals(stopped) == refusals(whole) and refusals(whole)["count"] > 0
    assert _records(stopped) == _records(whole)


def test_a_checkpoint_s_refusal_counts_are_read_as_untrusted_input():
    from edgefl.server.rejections import Rejections

    good = Rejections()
    good.add("dev-1", "stale: trained from server version 3")
    assert Rejections.from_saved(good.saved()).summary() == good.summary()
    for hostile in (None, [], {"total": -1}, {"total": True}, {"by_reason": {"x": "9"}}, {"by_sender": {"a": 2**70}}):
        assert Rejections.from_saved(hostile).total == 0 and not Rejections.from_saved(hostile).by_sender
    flood = Rejections.from_saved({"total": 5, "by_sender": {f"d{i}": 1 for i in range(10_000)}})
    assert len(flood.by_sender) <= 201  # the cap on distinct keys holds
    odd = Rejections.from_saved({"total": 1, "by_reason": {"k #": 1}, "examples": {"k #": "x" * 10_000, "absent": "y", "n": 3}})
    assert odd.examples == {"k #": "x" * 300}  # bounded, and only for reasons it counts


def test_a_folded_refusal_reason_keeps_its_first_refusal_word_for_word():
    from edgefl.server.rejections import Rejections

    refused = Rejections()
    refused.add("dev-1", "upload of 300000000 bytes is over network.max_message_bytes (268435456)")
    refused.add("dev-2", "upload of 999 bytes is over network.max_message_bytes (268435456)")
    refused.add("dev-3", "unknown sender")
    summary = refused.summary()
    (kind,) = [k for k in summary["by_reason"] if "upload" in k]
    assert "#" in kind and summary["by_reason"][kind] == 2
    assert summary["examples"] == {kind: "upload of 300000000 bytes is over network.max_message_bytes (268435456)"}
    assert Rejections.from_saved(refused.saved()).summary() == summary


def test_tensors_that_share_a_storage_are_saved_apart_and_a_whole_one_is_not_copied(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from edgefl.server.state import savable

    base = torch.arange(12.0)
    tied = torch.randn(3, 4)
    tensors = {"whole": base, "view": base[2:5], "again": base, "tied_a": tied, "tied_b": tied, "t": tied.t()}
    ready = savable(tensors)
    assert ready["whole"].data_ptr() == base.data_ptr()  # no second copy of a tensor that owns its storage
    save_file(ready, str(tmp_path / "s.safetensors"))  # safetensors refuses shared storages: none are left
    back = load_file(str(tmp_path / "s.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_a_checkpoint_from_before_eval_unselected_resumes_with_the_numbers_it_began_with(tmp_path):
    """A checkpoint written by an older edgefl carries the whole-config digest of a config without
    eval.unselected: it resumes, going on as that run began (last_reported)."""
    import hashlib
    import json

    import tomli_w
    from safetensors import safe_open
    from safetensors.torch import save_file

    def config(unselected: str) -> RunConfig:
        raw = method_config("fedhe", rounds=4)
        raw.update(threads=1, eval={"every": 2, "unselected": unselected})
        raw["fleet"]["sample_ratio"] = 0.5
        raw.setdefault("simulation", {})["checkpoint_every"] = 2
        return RunConfig.model_validate(raw)

    old = config("last_reported")
    whole = RunDir.create(tmp_path / "whole", old.name, old.seed)
    Simulation(old, whole, show_progress=False).run()
    stopped = RunDir.create(tmp_path / "stopped", old.name, old.seed)
    played: list[int] = []
    Simulation(old, stopped, show_progress=False, on_round=lambda r: played.append(r["round"])).run(should_stop=lambda: len(played) >= 2)
    # make the run directory look as an older edgefl left it: no eval.unselected anywhere
    raw = old.to_dict()
    del raw["eval"]["unselected"]
    (stopped.path / "config.toml").write_text(tomli_w.dumps(raw))
    state = stopped.path / "server-state.safetensors"
    with safe_open(str(state), framework="pt") as f:
        meta = json.loads(f.metadata()["edgefl"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta["extra"]["config_sha256"] = hashlib.sha256(tomli_w.dumps(raw).encode()).hexdigest()
    save_file(tensors, str(state), metadata={"edgefl": json.dumps(meta)})

    from edgefl.config import load_config

    resumed_cfg = load_config(stopped.path / "config.toml", [])
    assert resumed_cfg.eval.unselected == "ask"  # today's default, which the older run did not have
    again = Simulation(resumed_cfg, RunDir(stopped.path), show_progress=False)
    again.resume()
    assert again.cfg.eval.unselected == "last_reported"
    again.run()
    assert _records(stopped.path) == _records(whole.path)


def test_a_resume_that_turns_checkpoints_off_says_so(tmp_path):
    cfg = _config("fedavg", rounds=2, every=1)
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    played: list[int] = []
    Simulation(cfg, run, show_progress=False, on_round=lambda r: played.append(r["round"])).run(should_stop=lambda: len(played) >= 1)
    off = _config("fedavg", rounds=2, every=0)
    with pytest.raises(ConfigError, match="a resume needs checkpoints") as exc:
        Simulation(off, RunDir(run.path), show_progress=False).resume()
    assert "the run's config.toml" in exc.value.hint and "checkpoint_every above 0" in exc.value.hint
    # another run's config altogether (an outside trial passed another table's cell): said so, not the interval
    other = _config("fedavg", rounds=5, every=0)
    with pytest.raises(ConfigError, match="has another config: rounds 2 -> 5") as exc:
        Simulation(other, RunDir(run.path), show_progress=False).resume()
    assert "own config.toml" in exc.value.hint


def test_a_finished_fleet_run_is_not_resumed_nor_rewritten(tmp_path):
    """`edgefl server --resume` on a run that ended by itself says so and leaves it as it is (it
    rewrote the summary, with a wall time of milliseconds, and the models before)."""
    import json

    from edgefl.cli import app

    cfg = _config("fedavg", rounds=2, every=1)
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    (run.path / "config.toml").write_text(cfg.to_toml())
    summary = {"interrupted": False, "rounds_played": 2, "wall_time_s": 33.0}
    (run.path / "summary.json").write_text(json.dumps(summary))
    res = CliRunner().invoke(app, ["server", "--broker", "mqtt://127.0.0.1:9", "--config", str(run.path / "config.toml"),
                                   "--out", str(run.path), "--resume"])  # port 9: nothing listens, nothing is tried
    assert res.exit_code == 0, res.output
    assert "holds a finished run: nothing to resume" in res.output
    assert json.loads((run.path / "summary.json").read_text()) == summary


def test_the_report_names_who_declined_who_was_missing_and_the_refusals(tmp_path):
    import json

    from edgefl.report import participation_notes

    run = RunDir.create(tmp_path / "run", "r", 0)
    (run.path / "partition.json").write_text(json.dumps({"clients": [
        {"client_id": "client-0", "stage": "ready"}, {"client_id": "client-2", "stage": "declined", "reason": "x.npz does not exist"}]}))
    for r, missing in ((1, []), (2, ["client-1"]), (3, ["client-1"])):
        run.append_metrics({"round": r, "missing": missing})
    (run.path / "summary.json").write_text(json.dumps({"rejections": {"count": 3}}))
    notes = participation_notes(run)
    assert notes[0] == "client-2 declined: x.npz does not exist"
    assert notes[1].startswith("client-1 missing in 2 rounds (2, 3;")
    assert notes[2].startswith("3 messages refused")
    assert participation_notes(RunDir.create(tmp_path / "empty", "r", 0)) == []  # nothing written: nothing said
