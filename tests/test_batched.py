"""Same-architecture clients trained together (simulation.batch_clients) give the numbers of
training them one after another: per-client losses, accuracies and the trained models.

"Within float tolerance", and why not bit for bit: the batched step computes convolutions as one
grouped kernel, which sums in another order (1e-6 relative), and where a max-pool window holds a
tie (Fashion-MNIST's zero background gives many) the two kernels may route the gradient to
different, equally valid positions; the effect grows over steps (most with Adam, which divides
by the gradient's running size). The tolerances below are what three rounds show; a wrong mask,
batch order or optimizer step misses them by orders of magnitude.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from edgefl.algorithms.fedavg import FedAvgClient
from edgefl.config import validate_config
from edgefl.sim.engine import Simulation
from tests.conftest import digits_config

RESNETS = [{"model": "resnet10", "count": 3, "options": {"width": 0.25}},
           {"model": "resnet14", "count": 2, "options": {"width": 0.25}}]
FEDHE_CNNS = [{"model": "fedhe-cnn-0", "count": 3, "options": {"width": 0.25}},  # dropout 0.2: masks must match too
              {"model": "fedhe-cnn-5", "count": 2, "options": {"width": 0.25}}]


def _run(method: str, groups: list[dict], batch: str, optimizer: str = "sgd", rounds: int = 3, train: dict | None = None,
         **options):
    raw = digits_config(method, rounds=rounds)
    # Fashion-MNIST, not digits: ResNets shrink 8x8 digits to a few pixels, where batch norm divides
    # by near-zero variances and a 1e-7 nudge of the weights (even between two one-at-a-time runs)
    # moves the result by 1e-2; at 28x28 the training is well conditioned
    raw["data"] = {"dataset": "fashion-mnist", "partition": "dirichlet", "alpha": 0.5, "samples_per_client": 90,
                   "min_samples": 10, "test_samples": 500}
    raw["fleet"] = {"groups": [{**g, "options": dict(g["options"])} for g in groups]}
    raw["method"].update(options)
    raw["train"]["optimizer"] = optimizer
    raw["train"].update(train or {})
    raw["simulation"] = {"batch_clients": batch}
    if "feature_dim" in options:
        for g in raw["fleet"]["groups"]:
            g["options"]["feature_dim"] = options["feature_dim"]
    sim = Simulation(validate_config(raw), show_progress=False)
    sim.run()
    models = {cid: {k: v.detach().clone() for k, v in c.model.state_dict().items()} for cid, c in sim.clients.items()}
    return sim, models


def _same_numbers(method: str, groups: list[dict], optimizer: str = "sgd", state_tol: float = 1e-2, loss_tol: float = 1e-3,
                  acc_tol: float = 0.01, rounds: int = 3, train: dict | None = None, **options) -> Simulation:
    alone, alone_models = _run(method, groups, "off", optimizer, rounds, train, **options)
    together, together_models = _run(method, groups, "on", optimizer, rounds, train, **options)
    assert together.batcher is not None and together.batcher.batched > 0 and together.batcher.alone == 0
    for one, other in zip(alone.history, together.history):
        assert one["train_loss"].keys() == other["train_loss"].keys()
        for cid, loss in one["train_loss"].items():
            assert other["train_loss"][cid] == pytest.approx(loss, rel=loss_tol, abs=1e-5), (one["round"], cid)
        assert other["accuracy"]["overall"] == pytest.approx(one["accuracy"]["overall"], abs=acc_tol)
    for cid, state in alone_models.items():  # float noise: kernels that sum in another order
        for name, tensor in state.items():
            scale = max(1.0, float(tensor.float().abs().max()))
            gap = float((together_models[cid][name].float() - tensor.float()).abs().max())
            assert gap <= state_tol * scale, (cid, name, gap, scale)
    return together


def test_fedavg_resnets_batched_match_one_at_a_time():
    _same_numbers("fedavg", RESNETS)


def test_fedavg_resnets_with_adam_match_too():
    # Adam divides by the gradient's running size, so float noise in tiny gradients moves weights
    # by up to lr per step either way: one round, with a looser tolerance
    _same_numbers("fedavg", RESNETS, optimizer="adam", state_tol=2e-2, loss_tol=5e-3, acc_tol=0.02, rounds=1)


def test_a_learning_rate_schedule_batched_matches_one_at_a_time():
    # rounds 3 and 4 of 4 train at a tenth of the rate: the batched step takes the round's rate too
    scheduled = _same_numbers("fedavg", RESNETS, rounds=4, train={"lr_milestones": [0.5]})
    plain, _ = _run("fedavg", RESNETS, "on", rounds=4)
    last, last_plain = scheduled.history[-1]["train_loss"], plain.history[-1]["train_loss"]
    assert all(abs(last[c] - last_plain[c]) > 1e-3 * last_plain[c] for c in last)  # beyond the tolerance above


def test_fedhe_cnns_with_dropout_batched_match_one_at_a_time():
    _same_numbers("fedhe", FEDHE_CNNS, warmup_rounds=1)


@pytest.mark.parametrize("alleviation", ["simplified", "projection"])
def test_fedin_resnets_batched_match_one_at_a_time(alleviation):
    _same_numbers("fedin", RESNETS, alleviation=alleviation)


def test_felo_resnets_batched_match_one_at_a_time():
    _same_numbers("felo", RESNETS, feature_dim=32, warmup_rounds=1)


def test_a_method_without_a_batched_form_trains_one_at_a_time_and_says_so_once(caplog):
    caplog.set_level(logging.WARNING, logger="edgefl.sim")
    alone, _ = _run("fedin", RESNETS, "off", alleviation="none")
    sim, _ = _run("fedin", RESNETS, "on", alleviation="none")  # "w/o Opt" takes two optimizer steps per batch
    said = [r for r in caplog.records if "one at a time" in r.getMessage()]
    assert len(said) == 1 and "FedINClient" in said[0].getMessage()
    assert sim.batcher.alone == 10 and sim.batcher.batched == 5  # round 1 has no pairs yet: batched
    assert sim.history[-1]["train_loss"] == pytest.approx(alone.history[-1]["train_loss"], rel=1e-3)


def test_batch_clients_auto_is_off_on_the_cpu_and_recorded(tmp_path):
    from edgefl.rundir import RunDir

    raw = digits_config("fedavg", rounds=1)
    raw["device"] = "cpu"
    sim = Simulation(validate_config(raw), run_dir=RunDir.create(tmp_path, "t", 0), show_progress=False)
    sim.run()
    assert sim.batcher is None
    run = json.loads((sim.run_dir.path / "run.json").read_text())
    assert run["simulation"]["batch_clients"] is False and run["compute_device"] == "cpu"


def test_cuda_without_a_gpu_is_a_config_error_that_says_what_to_do():
    from edgefl.errors import ConfigError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    raw = digits_config("fedavg", rounds=1)
    raw["device"] = "cuda"
    with pytest.raises(ConfigError, match="no CUDA device") as info:
        Simulation(validate_config(raw), show_progress=False)
    assert "auto" in (info.value.hint or "")


def test_a_model_drawing_other_randomness_is_refused_before_any_client_changes():
    from torch import nn

    from edgefl.algorithms.batched import NotBatchable, train_together
    from edgefl.build import build_run

    cfg = validate_config(digits_config("fedavg", rounds=1))
    parts = build_run(cfg)
    clients = [parts.client(s.client_id) for s in parts.slots if s.model == "mlp"]
    for c in clients:
        c.model.noise = nn.Dropout2d(0.1)  # a random layer whose masks the batched step cannot redraw
    before = [{k: v.clone() for k, v in c.model.state_dict().items()} for c in clients]
    with pytest.raises(NotBatchable, match="Dropout2d"):
        train_together(clients, [c.batch_plan(None, 1) for c in clients])
    for c, state in zip(clients, before):
        assert all(torch.equal(v, state[k]) for k, v in c.model.state_dict().items())



class ProxClient(FedAvgClient):
    """A plug-in's FedProx-like client: FedAvg's client with its own fit (counting its calls here)."""

    def fit(self, downlink, round_no):
        self.fit_calls = getattr(self, "fit_calls", 0) + 1
        return super().fit(downlink, round_no)


def test_a_subclass_that_changes_fit_but_inherits_batch_plan_trains_one_at_a_time(caplog):
    """An outside trial: a plug-in's FedProx over FedAvg's client inherited FedAvg's batch_plan, so a
    batched round trained plain FedAvg without a word. Such a client now trains one at a time."""
    from edgefl.methods import METHODS, MethodSpec, register_method
    from edgefl.sim.batching import _plan_not_for_fit

    class ProxBatched(ProxClient):
        def batch_plan(self, downlink, round_no):
            return super().batch_plan(downlink, round_no)

    class Renamed(FedAvgClient):
        pass

    assert "overrides fit" in _plan_not_for_fit(ProxClient) and "inherits batch_plan from FedAvgClient" in _plan_not_for_fit(ProxClient)
    assert _plan_not_for_fit(ProxBatched) == _plan_not_for_fit(Renamed) == _plan_not_for_fit(FedAvgClient) == ""
    fedavg = METHODS["fedavg"]
    register_method(MethodSpec("prox-test", "FedAvg with its own fit", f"{__name__}:ProxClient", fedavg.server_path,
                               fedavg.options_path, uploads=fedavg.uploads, downloads=fedavg.downloads))
    try:
        caplog.set_level(logging.WARNING, logger="edgefl.sim")
        sim, _ = _run("prox-test", RESNETS, "on", rounds=1)
    finally:
        METHODS.pop("prox-test")
    assert sim.batcher.batched == 0 and sim.batcher.alone == 5
    assert all(getattr(c, "fit_calls", 0) == 1 for c in sim.clients.values())  # its own fit trained every client
    assert any("inherits batch_plan" in r.getMessage() for r in caplog.records)
