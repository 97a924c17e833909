"""Felo and Velo: Eq. 1 by hand, per-class averaging, the feature CVAE, the feature-width rule."""

from __future__ import annotations

import math

import pytest
import torch

from edgefl.algorithms.felo import KNOWLEDGE, SAMPLE_FEATURES, SAMPLE_LABELS, FeloOptions, SampleKeeper, VeloOptions, felo_loss
from edgefl.errors import ConfigError
from edgefl.messages import Message, decode, encode
from edgefl.models import build_model, get_spec, model_names
from edgefl.server.methods import ClientInfo
from edgefl.server.methods.felo import FeloServer, VeloServer
from edgefl.server.methods.feature_cvae import FeatureCVAE, train_feature_cvae


def test_felo_loss_against_hand_computed_values():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    feats = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    y = torch.tensor([0, 1])
    server_feats = torch.tensor([[[0.0, 2.0]], [[0.0, 0.0]]])  # [C, 1, F]
    server_logits = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([True, False])  # class 1 was never reported: CE only for sample 1
    opts = FeloOptions(alpha=0.5, logit_loss="kl", feature_dim=2)
    got = felo_loss(logits, feats, y, server_feats, server_logits, mask, opts)
    ce = (-math.log(math.exp(2) / (math.exp(2) + 1)) - math.log(math.e / (math.e + 1))) / 2
    mse0 = ((1 - 0) ** 2 + (2 - 2) ** 2) / 2  # 0.5
    p_student = [math.exp(2) / (math.exp(2) + 1), 1 / (math.exp(2) + 1)]
    kl0 = sum(0.5 * math.log(0.5 / q) for q in p_student)  # KL(teacher uniform || student)
    expected = ce + 0.5 * (mse0 + kl0) / 2  # the batch mean: sample 1 contributes 0
    assert float(got) == pytest.approx(expected, rel=1e-6)
    opts_mse = FeloOptions(alpha=1.0, logit_loss="mse", feature_dim=2)
    got = felo_loss(logits, feats, y, server_feats, server_logits, mask, opts_mse)
    assert float(got) == pytest.approx(ce + (mse0 + ((2 - 1) ** 2 + (0 - 1) ** 2) / 2) / 2, rel=1e-6)


def infos(models=("mlp", "mlp", "mlp"), counts=(10, 30, 60), hidden=((8,), (8,), (6,))):
    return [ClientInfo(f"c{i}", f"mlp(hidden={list(h)})", m, {"hidden": list(h), "feature_dim": 4}, n, input_shape=(5,))
            for i, (m, n, h) in enumerate(zip(models, counts, hidden))]


def upload(s: FeloServer, sender: str, classes, feats, logits, counts, weight_value: float = 1.0, round_no: int = 1) -> Message:
    arch = s.clients[sender].arch
    tensors = {k: torch.full_like(v, weight_value) if v.is_floating_point() else v for k, v in s.group_weights[arch].items()}
    tensors.update({KNOWLEDGE + "classes": torch.tensor(classes), KNOWLEDGE + "counts": torch.tensor(counts),
                    KNOWLEDGE + "features": torch.tensor(feats, dtype=torch.float32),
                    KNOWLEDGE + "logits": torch.tensor(logits, dtype=torch.float32)})
    return Message("class_features", round_no, sender, tensors, {"num_samples": s.clients[sender].num_samples})


def test_per_class_averaging_with_uneven_counts_and_a_missing_class():
    s = FeloServer(infos(), FeloOptions(feature_dim=4), seed=0, num_classes=3, input_shape=(5,))
    s.begin_round(1)
    assert s.receive(upload(s, "c0", [0, 1], [[1, 1, 1, 1], [2, 2, 2, 2]], [[1, 0, 0], [0, 1, 0]], [1, 3])).ok
    assert s.receive(upload(s, "c1", [1], [[6, 6, 6, 6]], [[0, 5, 0]], [1])).ok
    s.close_round(1)
    feats, logits, mask = s.class_averages()
    assert mask.tolist() == [True, True, False]
    torch.testing.assert_close(feats[1], torch.full((4,), (2 * 3 + 6 * 1) / 4))  # count-weighted
    torch.testing.assert_close(logits[1], torch.tensor([0.0, (1 * 3 + 5) / 4, 0.0]))
    assert float(feats[2].abs().sum()) == 0.0  # never reported: zeros, masked out
    down = decode(encode(s.downlink(2, "c2")))
    assert down.tensors[KNOWLEDGE + "mask"].tolist() == [True, True, False]
    assert tuple(down.tensors[KNOWLEDGE + "features"].shape) == (3, 1, 4)


def test_same_architecture_averaging_never_mixes_architectures():
    s = FeloServer(infos(), FeloOptions(feature_dim=4), seed=0, num_classes=3, input_shape=(5,))
    before_b = {k: v.clone() for k, v in s.group_weights["mlp(hidden=[6])"].items()}
    s.begin_round(1)
    s.receive(upload(s, "c0", [0], [[1, 1, 1, 1]], [[1, 0, 0]], [2], weight_value=1.0))
    s.receive(upload(s, "c1", [0], [[1, 1, 1, 1]], [[1, 0, 0]], [2], weight_value=5.0))
    s.close_round(1)
    a = s.group_weights["mlp(hidden=[8])"]
    assert float(a["head.weight"][0, 0]) == pytest.approx((1 * 10 + 5 * 30) / 40)
    assert all(torch.equal(v, before_b[k]) for k, v in s.group_weights["mlp(hidden=[6])"].items())


def test_store_keeps_the_most_recent_reports_per_class():
    s = FeloServer(infos(), FeloOptions(feature_dim=4, store_size=2), seed=0, num_classes=3, input_shape=(5,))
    for r, value in ((1, 1.0), (2, 2.0), (3, 3.0)):
        s.begin_round(r)
        s.receive(upload(s, "c0", [0], [[value] * 4], [[value, 0, 0]], [1], round_no=r))
        s.close_round(r)
    assert [float(i.feature[0]) for i in s.store[0]] == [2.0, 3.0]
    assert float(s.class_averages()[0][0, 0]) == pytest.approx(2.5)


def test_hostile_knowledge_is_rejected():
    s = FeloServer(infos(), FeloOptions(feature_dim=4), seed=0, num_classes=3, input_shape=(5,))
    s.begin_round(1)
    assert "out of range" in s.receive(upload(s, "c0", [7], [[1, 1, 1, 1]], [[1, 0, 0]], [1])).reason
    assert "must be [1, 4]" in s.receive(upload(s, "c0", [0], [[1, 1]], [[1, 0, 0]], [1])).reason
    assert "finite" in s.receive(upload(s, "c0", [0], [[float("nan")] * 4], [[1, 0, 0]], [1])).reason
    assert "positive" in s.receive(upload(s, "c0", [0], [[1] * 4], [[1, 0, 0]], [0])).reason


def test_feature_cvae_generates_features_nearest_their_own_class():
    gen = torch.Generator().manual_seed(0)
    centres = torch.tensor([[4.0, 0, 0, 0, 1, 1], [0, 4.0, 0, 1, 0, 1], [0, 0, 4.0, 1, 1, 0]])
    y = torch.arange(3).repeat_interleave(200)
    s = (centres[y] + 0.2 * torch.randn(len(y), 6, generator=gen)).clamp(min=0)
    torch.manual_seed(0)
    cvae = FeatureCVAE(6, 3, latent_dim=4, hidden_dim=64)
    info = train_feature_cvae(cvae, s, y, epochs=60, lr=3e-3, generator=gen, device="cpu")
    assert info["seconds"] > 0 and info["samples"] == 600
    fake = cvae.generate(torch.arange(3), 50, torch.Generator().manual_seed(1))  # [3, 50, 6]
    means = torch.stack([s[y == c].mean(0) for c in range(3)])
    for c in range(3):
        nearest = torch.cdist(fake[c], means).argmin(1)
        assert bool((nearest == c).all()), f"class {c}: {nearest.tolist()}"


@pytest.mark.parametrize("name", [n for n in model_names() if get_spec(n).kind == "classifier"])
def test_feature_width_rule_holds_for_every_zoo_classifier(name):
    shape = get_spec(name).default_input_shape
    opts = {"width": 0.125} if name.startswith(("resnet", "fedhe-cnn", "vgg")) else {}
    model = build_model(name, num_classes=10, input_shape=shape, feature_dim=48, **opts).eval()
    x = torch.rand(2, *shape)
    logits, feats = model.forward_with_features(x)
    assert model.feature_dim == 48 and tuple(feats.shape) == (2, 48) and tuple(logits.shape) == (2, 10)


def test_a_model_of_another_width_is_refused_with_the_option_to_set():
    from tests.conftest import digits_config

    from edgefl.config import RunConfig
    from edgefl.sim.engine import Simulation

    raw = digits_config("felo", rounds=1, fleet={"groups": [{"model": "mlp", "count": 2, "options": {"hidden": [16]}}]})
    with pytest.raises(ConfigError, match="feature_dim = 512"):
        Simulation(RunConfig.model_validate(raw), show_progress=False)


@pytest.mark.parametrize("method", ["felo", "velo"])
def test_felo_and_velo_simulations_are_reproducible_and_learn(method):
    from tests.conftest import digits_config

    from edgefl.config import RunConfig
    from edgefl.sim.engine import Simulation

    groups = [{"model": "fedhe-cnn-0", "count": 2, "options": {"width": 0.125, "feature_dim": 32}},
              {"model": "mlp", "count": 2, "options": {"hidden": [32], "feature_dim": 32}}]
    extra = {"cvae_epochs": 5, "synthetic_per_class": 2} if method == "velo" else {}
    raw = digits_config(method, rounds=3, fleet={"groups": groups})
    raw["method"] = {"name": method, "feature_dim": 32, "warmup_rounds": 1, **extra}
    runs = []
    for _ in range(2):
        sim = Simulation(RunConfig.model_validate(raw), show_progress=False)
        runs.append(sim.run())
    assert runs[0]["final_accuracy"] == runs[1]["final_accuracy"]
    assert runs[0]["final_accuracy"]["overall"] > 0.3  # 10 classes: chance is 0.1
    if method == "velo":
        assert sim.history[-1]["server"]["cvae"]["seconds"] > 0


def test_velo_retrains_only_every_k_rounds():
    s = VeloServer(infos(), VeloOptions(feature_dim=4, retrain_every=3, cvae_epochs=2), seed=0, num_classes=3, input_shape=(5,))
    trained = []
    for r in range(1, 7):
        s.begin_round(r)
        s.receive(upload(s, "c0", [0, 1], [[1, 1, 1, 1], [2, 2, 2, 2]], [[1, 0, 0], [0, 1, 0]], [1, 1], round_no=r))
        trained.append("cvae" in s.close_round(r))
    assert trained == [True, False, True, False, False, True]  # first round, then rounds 3 and 6
    assert tuple(s.downlink(7, "c0").tensors[KNOWLEDGE + "features"].shape) == (3, 8, 4)


# --- Velo's CVAE on per-sample features (cvae_data = "sample_features", the authors' code) --------

def sample_upload(s: VeloServer, sender: str, labels, value: float = 1.0, width: int = 4, round_no: int = 1) -> Message:
    m = upload(s, sender, [0], [[1.0] * 4], [[1, 0, 0]], [1], round_no=round_no)
    m.tensors[SAMPLE_FEATURES] = torch.full((len(labels), width), value)
    m.tensors[SAMPLE_LABELS] = torch.tensor(labels, dtype=torch.int64)
    return m


def test_a_device_keeps_the_features_of_its_last_trained_samples():
    keeper = SampleKeeper(5)
    for start in (0, 3, 6):
        keeper.add(torch.arange(start, start + 3, dtype=torch.float32).unsqueeze(1).repeat(1, 2), torch.tensor([start % 3] * 3))
    t = keeper.tensors()
    assert t[SAMPLE_FEATURES][:, 0].tolist() == [4, 5, 6, 7, 8] and t[SAMPLE_LABELS].tolist() == [0, 0, 0, 0, 0]
    assert len(keeper.batches) == 2  # batches wholly before the last five are let go
    assert SampleKeeper(5).tensors() == {}


def test_velo_on_sample_features_keeps_the_most_recent_per_class_and_learns_from_them():
    opts = VeloOptions(feature_dim=4, cvae_data="sample_features", samples_per_upload=6, sample_store_size=4, cvae_epochs=1)
    s = VeloServer(infos(), opts, seed=0, num_classes=3, input_shape=(5,))
    s.begin_round(1)
    assert s.receive(sample_upload(s, "c0", [0, 0, 1, 2, 0, 0], value=1.0)).ok
    assert s.receive(sample_upload(s, "c1", [0, 1], value=2.0)).ok
    info = s.close_round(1)
    assert [len(rows) for rows in s.samples] == [4, 2, 1]  # class 0: six rows reported, the last four kept (c1's after c0's)
    assert s.samples[0][:, 0].tolist() == [1.0, 1.0, 1.0, 2.0]
    assert info["cvae"]["samples"] == 7  # the CVAE learned from the samples, not the three class means
    feats, labels = s.cvae_training_data()
    assert feats.shape == (7, 4) and labels.tolist() == [0, 0, 0, 0, 1, 1, 2]


def test_velo_on_sample_features_refuses_an_upload_without_them_or_with_bad_ones():
    opts = VeloOptions(feature_dim=4, cvae_data="sample_features", samples_per_upload=3)
    s = VeloServer(infos(), opts, seed=0, num_classes=3, input_shape=(5,))
    s.begin_round(1)
    assert "class.sample_features and class.sample_labels" in s.receive(upload(s, "c0", [0], [[1.0] * 4], [[1, 0, 0]], [1])).reason
    assert "1..3 samples" in s.receive(sample_upload(s, "c0", [0, 1, 2, 0])).reason
    assert "out of 0..2" in s.receive(sample_upload(s, "c0", [0, 5])).reason
    assert "[2, 4]" in s.receive(sample_upload(s, "c0", [0, 1], width=3)).reason
    assert "finite" in s.receive(sample_upload(s, "c0", [0, 1], value=float("nan"))).reason
    assert s.receive(sample_upload(s, "c0", [0, 1])).ok
    plain = VeloServer(infos(), VeloOptions(feature_dim=4), seed=0, num_classes=3, input_shape=(5,))
    plain.begin_round(1)
    assert plain.receive(upload(plain, "c0", [0], [[1.0] * 4], [[1, 0, 0]], [1])).ok  # the paper's Velo needs no samples


def test_velo_on_sample_features_runs_reproducibly_and_resumes_as_an_uninterrupted_run(tmp_path):
    from edgefl.config import RunConfig
    from edgefl.sim.engine import Simulation
    from tests.conftest import method_config
    from tests.test_every_method import _records
    from tests.test_resume import stopped_and_resumed

    raw = method_config("velo", rounds=4)
    raw["method"].update(cvae_data="sample_features", samples_per_upload=40, cvae_epochs=2)
    raw["threads"] = 1
    raw.setdefault("simulation", {})["checkpoint_every"] = 2
    cfg = RunConfig.model_validate(raw)
    sim = Simulation(cfg, show_progress=False)
    sim.run()
    clients = len(sim.clients)
    assert sim.history[0]["server"]["cvae"]["samples"] == 40 * clients  # every device's last 40 samples
    assert sim.history[-1]["bytes_up"] > 40 * 4 * raw["method"].get("feature_dim", 512) * clients
    whole, stopped = stopped_and_resumed(cfg, tmp_path)
    assert _records(stopped) == _records(whole)


def test_a_fleet_refuses_a_group_of_another_feature_width_before_any_device_is_built():
    from tests.conftest import digits_config

    from edgefl.build import build_run
    from edgefl.config import RunConfig

    groups = [{"model": "mlp", "count": 2, "options": {"hidden": [16], "feature_dim": 16}},
              {"model": "mlp", "count": 2, "options": {"hidden": [24, 24]}}]
    raw = digits_config("velo", rounds=2, fleet={"groups": groups})
    raw["method"] = {"name": "velo", "feature_dim": 16}
    with pytest.raises(ConfigError, match=r"fleet.groups\[1\]: mlp\(hidden=\[24, 24\]\) emits 24-wide") as caught:
        build_run(RunConfig.model_validate(raw))  # what the fleet server, --show-config and simulate all run first
    assert "options.feature_dim = 16" in caught.value.hint


def test_per_sample_features_count_toward_the_message_limit_at_start_up():
    from tests.conftest import digits_config

    from edgefl.build import build_run
    from edgefl.config import RunConfig

    groups = [{"model": "mlp", "count": 2, "options": {"hidden": [16], "feature_dim": 256}}]
    raw = digits_config("velo", rounds=2, fleet={"groups": groups})
    raw["method"] = {"name": "velo", "feature_dim": 256, "cvae_data": "sample_features", "samples_per_upload": 3000}
    raw["network"] = {"max_message_bytes": 2 << 20, "max_partial_bytes_total": 4 << 20}
    with pytest.raises(ConfigError, match="3.11 MB of class knowledge with 3000 per-sample features") as caught:
        build_run(RunConfig.model_validate(raw))
    assert "max_message_bytes = 4194304" in caught.value.hint
    raw["method"]["samples_per_upload"] = 500  # 0.5 MB beside 0.02 MB of weights: fits 2 MiB with the envelope's 1 MiB
    build_run(RunConfig.model_validate(raw))


def test_sample_options_without_sample_features_are_refused_with_what_to_set():
    with pytest.raises(ValueError, match='samples_per_upload size the per-sample features of cvae_data = "sample_features"'):
        VeloOptions(feature_dim=4, samples_per_upload=10)
    VeloOptions(feature_dim=4, cvae_data="sample_features", samples_per_upload=10, sample_store_size=20)
