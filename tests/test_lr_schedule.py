"""train.lr_milestones: the learning rate drops by lr_gamma at fractions of the run, as torch's
MultiStepLR over rounds (the Felo/Velo authors' code drops it ten-fold at half the run)."""

from __future__ import annotations

import pytest
import torch

from edgefl.config import TrainSettings, validate_config
from edgefl.errors import ConfigError
from edgefl.sim.engine import Simulation
from tests.conftest import digits_config


@pytest.mark.parametrize(("milestones", "total"), [([0.5], 200), ([0.4, 0.7], 50), ([0.3, 0.31], 7), ([0.99], 3)])
def test_each_round_trains_with_the_rate_multisteplr_gives_after_the_rounds_before_it(milestones, total):
    settings = TrainSettings(lr=0.01, lr_milestones=milestones, lr_gamma=0.5)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)
    torch_schedule = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(m * total) for m in milestones], gamma=0.5)
    for round_no in range(1, total + 1):
        assert settings.lr_at(round_no, total) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12), round_no
        opt.step()
        torch_schedule.step()


def test_no_schedule_is_written_nowhere_so_tasks_and_saved_runs_stay_as_they_were():
    assert "lr_milestones" not in TrainSettings().model_dump() and "lr_gamma" not in TrainSettings().model_dump()
    assert TrainSettings().for_round(5, 10) == TrainSettings()
    scheduled = TrainSettings(lr_milestones=[0.5], lr_gamma=0.2).model_dump()
    assert scheduled["lr_milestones"] == [0.5] and scheduled["lr_gamma"] == 0.2
    assert TrainSettings.model_validate(scheduled) == TrainSettings(lr_milestones=[0.5], lr_gamma=0.2)


@pytest.mark.parametrize(("milestones", "said"), [
    ([0.6, 0.3], "increasing order"), ([0.5, 0.5], "increasing order"), ([1.0], "below 1"), ([0], "above 0"),
    ([float("nan")], "fraction of the run"), ([0.01 * k for k in range(1, 18)], "at most 16"),
])
def test_a_schedule_that_means_nothing_is_refused_with_what_to_write(milestones, said):
    raw = digits_config("fedavg")
    raw["train"]["lr_milestones"] = milestones
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    assert said in str(err.value)


def _losses(milestones: list[float] | None, optimizer_state: str = "per_round", group_override: dict | None = None):
    raw = digits_config("fedavg", rounds=4)
    raw["train"]["optimizer_state"] = optimizer_state
    if milestones is not None:
        raw["train"]["lr_milestones"] = milestones
    if group_override is not None:
        raw["fleet"]["groups"][1]["train"] = group_override
    sim = Simulation(validate_config(raw), show_progress=False)
    sim.run()
    return sim, [record["train_loss"] for record in sim.history]


@pytest.mark.parametrize("optimizer_state", ["per_round", "kept"])
def test_the_rounds_before_a_milestone_are_untouched_and_the_ones_after_it_train_slower(optimizer_state):
    _, plain = _losses(None, optimizer_state)
    sim, dropped = _losses([0.5], optimizer_state)
    assert dropped[:2] == plain[:2]  # rounds 1 and 2 of 4 train at train.lr
    assert all(dropped[r] != plain[r] for r in (2, 3))
    if optimizer_state == "kept":  # the device's one optimizer carries its moments on at the dropped rate
        for client in sim.clients.values():
            assert client.kept_optimizer().param_groups[0]["lr"] == pytest.approx(0.003 * 0.1)


def test_a_group_keeps_its_own_schedule():
    sim, _ = _losses(None, group_override={"lr_milestones": [0.25], "lr_gamma": 0.5})
    rates = {cid: client.round_train(4).lr for cid, client in sim.clients.items()}
    groups = {cid: client.setup.arch.split("(")[0] for cid, client in sim.clients.items()}
    assert all(rates[c] == pytest.approx(0.003 * 0.5) for c in rates if groups[c] == "mlp")
    assert all(rates[c] == 0.003 for c in rates if groups[c] != "mlp")
    assert set(groups.values()) == {"mlp", "fedhe-cnn-0"}


def test_a_device_takes_the_schedule_from_its_task_and_a_plain_task_is_the_one_earlier_devices_know():
    from edgefl.build import build_run
    from edgefl.server.enrolment import task_for
    from edgefl.task import parse_task

    raw = digits_config("fedavg", rounds=10)
    raw["train"].update(lr_milestones=[0.3, 0.8], lr_gamma=0.5)
    cfg = validate_config(raw)
    parts = build_run(cfg)
    info = task_for(cfg, parts, parts.slots[0], "run-1", "fed").to_info()
    assert info["train"]["lr_milestones"] == [0.3, 0.8] and info["train"]["lr_gamma"] == 0.5
    task = parse_task(info)
    assert [task.train.lr_at(r, task.rounds) for r in (3, 4, 8, 9)] == pytest.approx([0.003, 0.0015, 0.0015, 0.00075])
    plain = validate_config(digits_config("fedavg", rounds=10))
    plain_info = task_for(plain, parts, parts.slots[0], "run-1", "fed").to_info()
    assert not {"lr_milestones", "lr_gamma"} & set(plain_info["train"])
    with pytest.raises(Exception, match="increasing order"):  # a hostile task is refused with the reason
        parse_task({**info, "train": {**info["train"], "lr_milestones": [0.9, 0.1]}})


@pytest.mark.parametrize(("rounds", "train", "said"), [
    (4, {"lr_milestones": [0.1, 0.5]}, "0.1 of 4 rounds falls before the first one"),
    (4, {"lr_milestones": [0.5, 0.6]}, "0.5 and 0.6 of 4 rounds both fall after round 2"),
    (1, {"lr_milestones": [0.5]}, "a run of 1 round has no later one"),
    (4, {"lr_gamma": 0.5}, "lr_gamma = 0.5 scales nothing without lr_milestones"),
])
def test_a_schedule_this_run_is_too_short_for_is_refused_before_it_trains_anything(rounds, train, said):
    raw = digits_config("fedavg", rounds=rounds)
    raw["train"].update(train)
    with pytest.raises(ConfigError, match=said):
        validate_config(raw)


def test_a_groups_schedule_is_checked_against_the_run_and_the_runs_gamma_may_serve_a_group():
    raw = digits_config("fedavg", rounds=4)
    raw["fleet"]["groups"][0]["train"] = {"lr_milestones": [0.05]}
    with pytest.raises(ConfigError, match=r"fleet.groups\[0\].train.lr_milestones: 0.05 of 4 rounds"):
        validate_config(raw)
    raw["fleet"]["groups"][0]["train"] = {"lr_milestones": [0.5]}
    raw["train"]["lr_gamma"] = 0.5  # the run's gamma, the group's milestones
    assert validate_config(raw).train_for(validate_config(raw).fleet.groups[0]).lr_at(3, 4) == pytest.approx(0.0015)
    raw["fleet"]["groups"][1]["train"] = {"lr_milestones": [], "lr_gamma": 0.5}  # a group's own gamma with no milestones of its own
    with pytest.raises(ConfigError, match=r"fleet.groups\[1\].train.lr_gamma = 0.5 scales nothing"):
        validate_config(raw)


def test_each_record_and_progress_line_say_the_rate_the_round_trained_with():
    from edgefl.sim.engine import round_line
    from edgefl.tracking import round_scalars

    sim, _ = _losses([0.5])
    assert [record["lr"] for record in sim.history] == pytest.approx([0.003, 0.003, 0.0003, 0.0003])
    assert round_line(sim.history[-1], 4).endswith("lr 0.0003")
    assert round_scalars(sim.history[-1])["train/lr"] == pytest.approx(0.0003)
    mixed, _ = _losses(None, group_override={"lr_milestones": [0.25], "lr_gamma": 0.5})
    last = mixed.history[-1]["lr"]
    assert sorted(last.values()) == pytest.approx([0.0015, 0.003])
    assert round_line(mixed.history[-1], 4).endswith("lr " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(last.items())))
    # groups on schedules of their own: every record names each one's rate, also round 1, where they agree
    assert all(isinstance(record["lr"], dict) and set(record["lr"]) == set(last) for record in mixed.history)
    assert set(round_scalars(mixed.history[0])) >= {f"train/lr/{k}" for k in last}
    plain, _ = _losses(None)
    assert all("lr" not in record for record in plain.history)  # no schedule: records as they were


def test_two_groups_of_one_architecture_at_different_rates_are_told_apart_in_the_record():
    raw = digits_config("fedavg", rounds=4)
    raw["fleet"]["groups"][1] = {"model": "mlp", "count": 1, "options": {"hidden": [32, 16]}}
    raw["fleet"]["groups"][0] = {"model": "mlp", "count": 1, "options": {"hidden": [32, 16]},
                                 "train": {"lr_milestones": [0.25], "lr_gamma": 0.5}}
    sim = Simulation(validate_config(raw), show_progress=False)
    sim.run()
    assert sim.history[-1]["lr"] == pytest.approx({"mlp(hidden=[32, 16]) (fleet.groups[0])": 0.0015,
                                                 "mlp(hidden=[32, 16]) (fleet.groups[1])": 0.003})
    # round 1 trains both at 0.003: its record keeps the two keys all the same
    assert all(set(record["lr"]) == set(sim.history[-1]["lr"]) for record in sim.history)


def test_a_fleet_console_s_closing_line_says_the_rate():
    import io
    import uuid

    from rich.console import Console

    from edgefl.cli import _fleet_printer
    from edgefl.fleet.launcher import run_fleet

    raw = digits_config("fedavg", rounds=2)
    raw["train"]["lr_milestones"] = [0.5]
    raw["fleet"]["groups"] = [{"model": "mlp", "count": 2, "options": {"hidden": [16]}}]
    raw["network"] = {"round_deadline_s": 60, "federation": f"lr-{uuid.uuid4().hex[:8]}"}
    buffer = io.StringIO()
    printer = _fleet_printer(Console(file=buffer, width=300, color_system=None), 2, None, 2)
    fleet = run_fleet(validate_config(raw), None, None, broker=f"memory://lr-{uuid.uuid4().hex[:8]}", device_timeout_s=120,
                      on_event=printer)
    assert set(fleet["device_exit_codes"].values()) == {0}
    closed = [line for line in buffer.getvalue().splitlines() if line.startswith("round ") and " reported" in line]
    assert [line.rsplit(", ", 1)[1] for line in closed] == ["lr 0.003", "lr 0.0003"]


def test_the_phone_example_follows_the_same_schedule_from_the_run_s_announced_length():
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "phone_device.py"
    spec = importlib.util.spec_from_file_location("phone_device_example", path)
    phone = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(phone)
    for milestones, total in [([0.5], 200), ([0.4, 0.7], 50), ([0.3, 0.31], 7)]:
        settings = TrainSettings(lr=0.05, lr_milestones=milestones, lr_gamma=0.5)
        assert [phone.round_rate(0.05, r, total, tuple(milestones), 0.5) for r in range(1, total + 1)] == \
            pytest.approx([settings.lr_at(r, total) for r in range(1, total + 1)])
    assert phone.round_rate(0.05, 9, None, (0.5,), 0.1) == 0.05  # the length not yet announced: the plain rate
    assert phone._milestones("0.5,0.75") == (0.5, 0.75)
    for bad in ("0.75,0.5", "1.5", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            phone._milestones(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        phone._gamma("0")
