"""Sample-level DP: DP-SGD on the device through Opacus (train.dp_sgd).

The options and what is refused before a run (bad values with their key, BatchNorm models without
``norm = "group"``, FedIN's loss, a target epsilon in an asynchronous run); the training loop
(with a huge clipping norm, no noise and fixed batches it is plain training; clipping bounds the
step; the noise is there and seeded; Poisson batches, empty ones included); DP-SGD runs of FedAvg
and FedHe whose uploads carry the device's epsilon as the accountant and Opacus' own accountant
give it, the same numbers for the same seed, in a simulation, an in-process fleet and a fleet of
device processes over mosquitto.
"""

from __future__ import annotations

import copy
import math
import uuid

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("opacus")

from opacus.accountants import RDPAccountant

from edgefl.algorithms import base
from edgefl.algorithms.base import ClientSetup
from edgefl.algorithms.fedavg import FedAvgClient, FedAvgOptions
from edgefl.algorithms.training import DPNoise, train_local
from edgefl.config import DPSGDSettings, RunConfig, TrainSettings, validate_config
from edgefl.errors import ConfigError
from edgefl.models import build_model, dp_sgd_ready
from edgefl.models.registry import dp_sgd_status
from edgefl.privacy.accounting import Gaussian
from edgefl.privacy.dp_sgd import DeviceDP, max_draws, noise_generator, steps_per_round
from edgefl.rundir import RunDir
from edgefl.seeding import generator
from tests.conftest import digits_config
from tests.test_every_method import _records


def dp_config(method: str = "fedavg", rounds: int = 2, **dp) -> dict:
    """The tiny digits run with DP-SGD: its FedHe CNN group built with GroupNorm, 120 samples a device."""
    raw = digits_config(method, rounds=rounds)
    raw["fleet"]["groups"][0]["options"]["norm"] = "group"
    raw["data"]["samples_per_client"] = 120
    raw["train"]["dp_sgd"] = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, **dp}
    return raw


def refusal(raw: dict) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    return caught.value


# --- options ---------------------------------------------------------------------------------------
def test_the_options_their_defaults_and_a_groups_own_table():
    raw = dp_config("fedhe")
    raw["fleet"]["groups"][1]["train"] = {"dp_sgd": {"target_epsilon": 8.0, "poisson": False}, "lr": 0.01}
    cfg = validate_config(raw)
    run, group = cfg.train_for(cfg.fleet.groups[0]).dp_sgd, cfg.train_for(cfg.fleet.groups[1])
    assert run == DPSGDSettings(noise_multiplier=1.0, max_grad_norm=1.0) and run.delta == 1e-5 and run.poisson
    # a group's table replaces the run's whole (unset keys take the defaults, not the run's values)
    assert group.dp_sgd == DPSGDSettings(target_epsilon=8.0, poisson=False) and group.lr == 0.01
    assert validate_config(cfg.to_dict()).to_dict() == cfg.to_dict()
    # plain training writes no dp_sgd key: tasks and run.json read as before
    assert "dp_sgd" not in TrainSettings().model_dump() and "dp_sgd" not in TrainSettings().model_dump(mode="json")


@pytest.mark.parametrize("dp, key, why", [
    ({"noise_multiplier": -0.5}, "train.dp_sgd.noise_multiplier", "greater than or equal to 0"),
    ({"noise_multiplier": 1.0, "delta": 1.0}, "train.dp_sgd.delta", "less than 1"),
    ({"noise_multiplier": 1.0, "delta": 0}, "train.dp_sgd.delta", "greater than 0"),
    ({"noise_multiplier": 1.0, "max_grad_norm": 0}, "train.dp_sgd.max_grad_norm", "greater than 0"),
    ({"target_epsilon": 0}, "train.dp_sgd.target_epsilon", "greater than 0"),
    ({"max_grad_norm": 1.0}, "train.dp_sgd", "needs noise_multiplier or target_epsilon"),
    ({"noise_multiplier": 1.0, "target_epsilon": 3.0}, "train.dp_sgd", "not both"),
    ({"noise_multipler": 1.0}, "train.dp_sgd.noise_multipler", "did you mean 'noise_multiplier'"),
    ({"noise_multiplier": 1.0, "poisson": "maybe"}, "train.dp_sgd.poisson", "boolean"),
])
def test_bad_options_are_refused_naming_the_key(dp, key, why):
    raw = digits_config("fedavg")
    raw["train"]["dp_sgd"] = dp
    message = refusal(raw).message
    assert f"\n{key}: " in message and why in message, message


def test_a_batchnorm_model_is_refused_before_the_run_with_the_option_that_fixes_it():
    raw = dp_config()
    del raw["fleet"]["groups"][0]["options"]["norm"]
    err = refusal(raw)
    assert "fleet.groups.0 (fedhe-cnn-0)" in err.message and "BatchNorm2d" in err.message
    assert "mixes the samples of a batch" in err.message and 'norm = "group"' in err.hint
    # a group's own dp_sgd table is checked against that group's model
    raw = digits_config("fedavg")
    raw["fleet"]["groups"][0]["train"] = {"dp_sgd": {"noise_multiplier": 1.0}}
    assert "fleet.groups.0 (fedhe-cnn-0)" in refusal(raw).message
    raw["fleet"]["groups"][0]["train"] = None
    raw["fleet"]["groups"][1]["train"] = {"dp_sgd": {"noise_multiplier": 1.0}}  # only the MLPs train with DP-SGD
    validate_config(raw)


def test_a_client_half_refuses_a_model_that_cannot_train_with_dp_sgd():
    """What model = "auto" gets is checked where the model is known: the client half."""
    train = TrainSettings(dp_sgd=DPSGDSettings(noise_multiplier=1.0))
    model = build_model("fedhe-cnn-0", input_shape=(1, 8, 8), width=0.125)
    setup = ClientSetup("client-0", "fedhe-cnn-0", model, torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long), 10, train, 0)
    with pytest.raises(ConfigError, match="BatchNorm2d") as caught:
        FedAvgClient(setup, FedAvgOptions())
    assert 'norm = "group"' in caught.value.hint


def test_fedin_is_refused_with_its_reason():
    raw = dp_config("fedin")
    err = refusal(raw)
    assert "method fedin" in err.message and "proximal term" in err.message and "rewrites" in err.message


def test_a_target_epsilon_in_an_asynchronous_run_is_refused():
    raw = dp_config("fedhe", target_epsilon=4.0)
    del raw["train"]["dp_sgd"]["noise_multiplier"]
    raw["mode"] = "async"
    err = refusal(raw)
    assert 'asynchronous run (mode = "async")' in err.message and "noise_multiplier" in err.hint
    raw["train"]["dp_sgd"] = {"noise_multiplier": 1.0}
    validate_config(raw)  # a given noise multiplier: the uploads say what each device spent


# --- the zoo -----------------------------------------------------------------------------------------
def test_the_zoo_says_which_models_train_with_dp_sgd():
    assert dp_sgd_ready(build_model("lenet5")) == (True, "every layer has per-sample gradients")
    ready, why = dp_sgd_ready(build_model("resnet10", width=0.125))
    assert not ready and "BatchNorm2d" in why and 'norm = "group"' in why
    assert dp_sgd_ready(build_model("resnet10", width=0.125, norm="group"))[0]
    grouped = build_model("fedhe-cnn-5", width=0.25, norm="group")
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in grouped.modules())
    # the GroupNorm Opacus' ModuleValidator.fix would put in place of each BatchNorm: the same architecture
    from opacus.validators import ModuleValidator

    fixed = ModuleValidator.fix(build_model("fedhe-cnn-5", width=0.25))
    assert {k: v.shape for k, v in fixed.state_dict().items()} == {k: v.shape for k, v in grouped.state_dict().items()}
    assert [repr(m) for m in fixed.modules() if isinstance(m, torch.nn.GroupNorm)] == \
           [repr(m) for m in grouped.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert [dp_sgd_status(n) for n in ("lenet5", "vgg9", "cvae-small", "mlp", "fedhe-cnn-0", "resnet18")] == \
           ["yes", "yes", "yes", "yes", "norm=group", "norm=group"]


def test_the_group_norm_resnet_computes_torchvisions_forward_and_trains_with_dp_sgd():
    torch.manual_seed(0)
    split, reference = build_resnet_pair()
    x = torch.randn(3, 1, 16, 16)
    split.eval()
    assert torch.allclose(split(x), reference(x), atol=1e-6)
    cfg = TrainSettings(batch_size=4, max_steps=2, dp_sgd=DPSGDSettings(noise_multiplier=1.0, max_grad_norm=1.0))
    stats = train_local(split, torch.randn(8, 1, 16, 16), torch.arange(8) % 10, cfg, generator(0, "t"),
                        lambda xb, yb: F.cross_entropy(split(xb), yb), dp=DPNoise(1.0, torch.Generator().manual_seed(1)))
    assert stats.steps == 2 and all(not hasattr(p, "grad_sample") for p in split.parameters())


def build_resnet_pair():
    from edgefl.models.resnet import build_resnet

    return build_resnet("resnet10", 10, (1, 16, 16), width=0.125, norm="group", return_reference=True)


# --- the training loop ------------------------------------------------------------------------------
def _data(n: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def _train(model, cfg: TrainSettings, noise_multiplier: float | None = None, noise_seed: int = 7, order_seed: int = 3):
    """One round of ``model`` (trained in place) on the fixed data; dropout seeded as a round is."""
    x, y = _data()
    torch.manual_seed(11)
    dp = None if noise_multiplier is None else DPNoise(noise_multiplier, torch.Generator().manual_seed(noise_seed))
    return train_local(model, x, y, cfg, generator(order_seed, "order"), lambda xb, yb: F.cross_entropy(model(xb), yb), dp=dp)


def _model(name: str = "fedhe-cnn-0"):
    torch.manual_seed(0)
    options = {"width": 0.125, "norm": "group"} if name.startswith("fedhe") else {}
    return build_model(name, input_shape=(1, 8, 8), **options)


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# not the GroupNorm CNN with Adam: with one channel a group the conv biases before each GroupNorm have
# a gradient of exactly 0 in exact arithmetic, rounding leaves ~1e-9 of either sign, and Adam's
# normalisation turns that into steps of +-lr whose signs the two summation orders draw differently
@pytest.mark.parametrize("name, optimizer", [("fedhe-cnn-0", "sgd"), ("mlp", "adam"), ("mlp", "sgd")])
def test_without_noise_with_a_huge_clip_and_fixed_batches_dp_sgd_is_plain_training(name, optimizer):
    """Per-sample gradients summed and divided by the batch's size are the batch gradient: with
    poisson = false (plain training's batches, the trailing one of a single sample skipped as
    there), noise 0 and a clip no gradient reaches, DP-SGD takes plain training's steps."""
    model = _model(name)
    plain_model = copy.deepcopy(model)
    base_cfg = dict(epochs=2, batch_size=13, optimizer=optimizer, lr=0.01)  # 40 = 3 x 13 + 1: the skipped batch of one
    plain = _train(plain_model, TrainSettings(**base_cfg))
    dp = _train(model, TrainSettings(**base_cfg, dp_sgd=DPSGDSettings(noise_multiplier=0.0, max_grad_norm=1e6, poisson=False)),
                noise_multiplier=0.0)
    assert (dp.steps, dp.samples) == (plain.steps, plain.samples) == (6, 78)
    assert dp.mean_loss == pytest.approx(plain.mean_loss, rel=1e-5)
    assert torch.allclose(_params(model), _params(plain_model), atol=1e-5, rtol=1e-4)
    assert not torch.equal(_params(model), _params(_model(name)))  # it trained
    assert all(not hasattr(p, a) for p in model.parameters() for a in ("grad_sample", "summed_grad", "_forward_counter"))
    assert all(m.inplace for m in model.modules() if hasattr(m, "inplace") and isinstance(m, torch.nn.ReLU))


def test_clipping_bounds_each_step():
    """SGD without momentum, lr 1, no noise: a step moves the weights by the mean of clipped
    per-sample gradients, at most max_grad_norm long (the batch gradient itself is far longer)."""
    model = _model("mlp")
    before = _params(model)
    cfg = TrainSettings(batch_size=40, optimizer="sgd", momentum=0.0, lr=1.0, max_steps=1,
                        dp_sgd=DPSGDSettings(noise_multiplier=0.0, max_grad_norm=1e-3, poisson=False))
    _train(model, cfg, noise_multiplier=0.0)
    step = float((_params(model) - before).norm())
    assert 0 < step <= 1e-3 * (1 + 1e-4)
    plain = _model("mlp")
    _train(plain, TrainSettings(batch_size=40, optimizer="sgd", momentum=0.0, lr=1.0, max_steps=1))
    assert float((_params(plain) - before).norm()) > 100 * step


def test_the_noise_is_there_seeded_and_of_its_size():
    cfg = TrainSettings(batch_size=40, optimizer="sgd", momentum=0.0, lr=1.0, max_steps=1,
                        dp_sgd=DPSGDSettings(noise_multiplier=2.0, max_grad_norm=0.5, poisson=False))
    runs = {}
    for key, z, seed in (("quiet", 0.0, 7), ("a", 2.0, 7), ("again", 2.0, 7), ("other", 2.0, 8)):
        model = _model("mlp")
        _train(model, cfg, noise_multiplier=z, noise_seed=seed)
        runs[key] = _params(model)
    assert torch.equal(runs["a"], runs["again"])  # the same noise seed: the same noise
    assert not torch.equal(runs["a"], runs["other"]) and not torch.equal(runs["a"], runs["quiet"])
    # one step, lr 1: the weights differ from the noiseless step by N(0, (z C)^2) / batch per coordinate
    noise = (runs["a"] - runs["quiet"]) * 40
    assert float(noise.std()) == pytest.approx(2.0 * 0.5, rel=0.1) and abs(float(noise.mean())) < 0.1


def test_poisson_batches_vary_in_size_may_be_empty_and_count_as_the_accountant_does():
    x, y = _data(n=10)
    model = _model("mlp")
    cfg = TrainSettings(epochs=3, batch_size=1, dp_sgd=DPSGDSettings(noise_multiplier=1.0))  # q = 0.1: 10 steps an epoch
    sizes = []
    loss = lambda xb, yb: (sizes.append(len(yb)), F.cross_entropy(model(xb), yb))[1]  # noqa: E731
    before = _params(model)
    stats = train_local(model, x, y, cfg, generator(0, "order"), loss, dp=DPNoise(1.0, torch.Generator().manual_seed(0)))
    assert stats.steps == 30 == steps_per_round(10, cfg) and stats.samples == sum(sizes)
    assert len(sizes) < 30  # some batches were empty: no forward pass, yet a step (noise alone) the accountant counts
    assert not torch.equal(before, _params(model))
    assert stats.samples <= max_draws(10, cfg)


def test_a_devices_noise_multiplier_from_its_target_epsilon():
    cfg = TrainSettings(epochs=2, batch_size=32, dp_sgd=DPSGDSettings(target_epsilon=3.0, delta=1e-5))
    dp = DeviceDP.for_device(cfg, samples=320, total_rounds=5)
    assert dp.sample_rate == 0.1 and dp.planned_steps == 5 * 2 * 10
    assert dp.epsilon(dp.planned_steps) <= 3.0 and dp.epsilon(dp.planned_steps) == pytest.approx(3.0, rel=0.02)
    assert DeviceDP.for_device(cfg, samples=160, total_rounds=5).noise_multiplier > dp.noise_multiplier  # fewer samples: more noise
    assert dp.meta_epsilon(0) == 0.0
    quiet = DeviceDP.for_device(TrainSettings(dp_sgd=DPSGDSettings(noise_multiplier=0.0)), 100, 3)
    assert quiet.epsilon(5) == math.inf and quiet.meta_epsilon(5) is None  # uploads carry finite numbers only


# --- runs ----------------------------------------------------------------------------------------------
@pytest.fixture
def uploads(monkeypatch):
    """Every upload a client half makes in this process (simulation, or an in-process fleet's threads)."""
    seen: list[tuple] = []
    reply = base.ClientHalf.reply

    def spy(self, kind, round_no, tensors, **meta):
        message = reply(self, kind, round_no, tensors, **meta)
        seen.append((self.client_id, round_no, message, self.num_samples))
        return message

    monkeypatch.setattr(base.ClientHalf, "reply", spy)
    return seen


def _run(raw: dict, where=None):
    from edgefl.sim import Simulation

    cfg = validate_config(raw)
    return Simulation(cfg, None if where is None else RunDir.create(where, cfg.name, cfg.seed), show_progress=False).run()


def _opacus_epsilon(z: float, q: float, steps: int, delta: float) -> float:
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=z, sample_rate=q)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("method", ["fedavg", "fedhe"])
def test_a_dp_sgd_run_uploads_each_devices_epsilon(method, uploads, tmp_path):
    _run(dp_config(method), tmp_path)
    records = _records(tmp_path)
    assert [(r["outcome"], r["accepted"], r["rejected"]["count"]) for r in records] == [("complete", 4, 0)] * 2
    assert len(uploads) == 8
    for _, round_no, message, n in uploads:
        steps = round_no * (n // 32)  # Poisson: 1 / q = samples // batch steps an epoch, one epoch a round
        eps = message.meta["dp_sgd_epsilon"]
        assert isinstance(eps, float) and eps == Gaussian(1.0, 32 / n, steps).epsilon(1e-5)
        assert eps == pytest.approx(_opacus_epsilon(1.0, 32 / n, steps, 1e-5), rel=1e-3)  # Opacus' accountant, stepped
        if method == "fedhe":
            # Poisson draws: a round's counts may pass samples x epochs (the server must allow max_draws)
            train = validate_config(dp_config(method)).train
            assert int(message.tensors["counts"].sum()) <= max_draws(n, train)
    by_client = {}
    for client, _, message, _ in uploads:
        by_client.setdefault(client, []).append(message.meta["dp_sgd_epsilon"])
    assert all(a < b for a, b in by_client.values())  # spent over the rounds
    # the records, the summary and the console line say what the devices reported
    import json

    from edgefl.report import stage_notes

    last = {client: eps[-1] for client, eps in by_client.items()}
    assert records[-1]["dp_sgd_epsilon"] == {c: round(e, 6) for c, e in sorted(last.items())}
    assert records[-1]["dp_sgd"]["epsilon_max"] == round(max(last.values()), 6) and records[-1]["dp_sgd"]["delta"] == 1e-5
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["privacy"]["dp-sgd"]["epsilon_max"] == records[-1]["dp_sgd"]["epsilon_max"]
    assert f"dp-sgd epsilon {max(last.values()):.3g} (delta 1e-05)" in stage_notes(records[-1])


def test_the_same_seed_gives_the_same_numbers_and_no_noise_other_numbers(uploads):
    raw = dp_config("fedavg", rounds=1)
    first = _run(raw)
    got = [(c, m.meta, m.tensors) for c, _, m, _ in uploads]
    uploads.clear()
    assert _run(raw)["final_accuracy"] == first["final_accuracy"]
    again = [(c, m.meta, m.tensors) for c, _, m, _ in uploads]
    assert [(c, meta) for c, meta, _ in got] == [(c, meta) for c, meta, _ in again]
    assert all(all(torch.equal(a[k], b[k]) for k in a) for (_, _, a), (_, _, b) in zip(got, again))
    uploads.clear()
    _run(dp_config("fedavg", rounds=1, noise_multiplier=0.0))
    quiet = [(c, m.meta, m.tensors) for c, _, m, _ in uploads]
    assert all(meta["dp_sgd_epsilon"] is None for _, meta, _ in quiet)  # no noise: no guarantee to state
    assert all(not torch.equal(a["head.weight"], b["head.weight"]) for (_, _, a), (_, _, b) in zip(got, quiet))


def test_a_memory_fleet_uploads_what_the_simulation_uploads(uploads):
    from edgefl.fleet.launcher import run_fleet

    raw = dp_config("fedavg")
    # MLPs: an in-process fleet's devices are threads sharing torch's global RNG, which dropout draws from
    raw["fleet"]["groups"] = [{"model": "mlp", "count": 2, "options": {"hidden": [32, 16]}},
                              {"model": "mlp", "count": 2, "options": {"hidden": [24]}}]
    raw["network"] = {"round_deadline_s": 60, "federation": f"dp-sgd-{uuid.uuid4().hex[:8]}"}
    raw["threads"] = 1
    cfg = RunConfig.model_validate(raw)
    sim = _run(raw)
    simulated = sorted((c, r, m.meta["dp_sgd_epsilon"], m.tensors) for c, r, m, _ in uploads)
    uploads.clear()
    fleet = run_fleet(cfg, None, None, broker=f"memory://dp-sgd-{uuid.uuid4().hex[:8]}", device_timeout_s=120)
    assert set(fleet["device_exit_codes"].values()) == {0}
    fleet_uploads = sorted((c, r, m.meta["dp_sgd_epsilon"], m.tensors) for c, r, m, _ in uploads)
    assert [u[:3] for u in fleet_uploads] == [u[:3] for u in simulated]
    assert all(all(torch.equal(a[k], b[k]) for k in a) for (*_, a), (*_, b) in zip(fleet_uploads, simulated))
    assert fleet["final_accuracy"] == sim["final_accuracy"]


def test_the_steps_survive_a_restart_through_the_carried_state():
    train = TrainSettings(batch_size=8, dp_sgd=DPSGDSettings(noise_multiplier=1.0))
    x, y = _data(n=32)

    def client():
        return FedAvgClient(ClientSetup("client-0", "mlp", _model("mlp"), x, y, 10, train, 0), FedAvgOptions())

    first = client()
    first.fit(None, 1)
    assert first.dp_sgd_steps == 4
    restarted = client()
    restarted.load_carry_state(first.carry_state())
    assert restarted.dp_sgd_steps == 4
    message = restarted.fit(None, 2)
    assert restarted.dp_sgd_steps == 8 and message.meta["dp_sgd_epsilon"] == Gaussian(1.0, 0.25, 8).epsilon(1e-5)
    # the noise of a round comes from (seed, "dp-sgd", device, round) on the device the model trains on
    a, b = noise_generator(0, "client-0", 2, torch.device("cpu")), noise_generator(0, "client-0", 2, torch.device("cpu"))
    assert torch.equal(torch.randn(3, generator=a), torch.randn(3, generator=b))


def test_a_fleet_of_device_processes_ends_with_the_simulations_numbers(tmp_path, monkeypatch):
    """FedHe with DP-SGD over mosquitto, one edgefl client process per device (the GroupNorm CNNs
    draw dropout masks too): every device's accuracy is the simulation's."""
    import shutil
    import tempfile

    from edgefl.fleet.launcher import run_fleet

    if shutil.which("mosquitto") is None and shutil.which("mosquitto", path="/usr/sbin") is None:
        pytest.skip("mosquitto is not installed")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    raw = dp_config("fedhe")
    raw["network"] = {"round_deadline_s": 120, "federation": f"dp-sgd-{uuid.uuid4().hex[:8]}"}
    raw["threads"] = 1
    cfg = RunConfig.model_validate(raw)
    sim = _run(raw)
    fleet = run_fleet(cfg, None, None, device_timeout_s=300)
    assert set(fleet["device_exit_codes"].values()) == {0} and [h["outcome"] for h in fleet["history"]] == ["complete"] * 2
    assert fleet["final_accuracy"]["per_client"] == sim["final_accuracy"]["per_client"]
    assert fleet["final_accuracy"]["overall"] == sim["final_accuracy"]["overall"]
