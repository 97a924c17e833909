"""FedIN: Eq. 13/14, the proximal term, layer-wise aggregation across depths, feature pairs."""

from __future__ import annotations

import pytest
import torch

from edgefl.algorithms.base import ClientSetup
from edgefl.algorithms.fedin import (
    PAIRS_PREFIX,
    FedINClient,
    FedINOptions,
    _KeepBatchNormStats,
    alleviate,
    project_conflict,
    proximal_term,
)
from edgefl.config import TrainSettings
from edgefl.messages import Message, decode, encode
from edgefl.models import build_model
from edgefl.server.methods import ClientInfo
from edgefl.server.methods.fedin import FedINServer, layerwise_average

RES = {"width": 0.0625, "stem": "imagenet"}  # 4-channel stem: tiny, still the real torchvision blocks
SHAPE = (1, 16, 16)


def arch(model: str, **opts) -> str:
    o = {**RES, **opts}
    return f"{model}({','.join(f'{k}={v}' for k, v in sorted(o.items()))})"


def make_server(models=("resnet10", "resnet14", "resnet18"), counts=(10, 30, 60), **options) -> FedINServer:
    infos = [ClientInfo(f"c{i}", arch(m), m, dict(RES), n, input_shape=SHAPE) for i, (m, n) in enumerate(zip(models, counts))]
    return FedINServer(infos, FedINOptions(**options), seed=0, num_classes=4, input_shape=SHAPE)


# --- Eq. 13 and Eq. 14 ------------------------------------------------------------------------
def test_projection_removes_only_the_conflicting_component():
    g_local = torch.tensor([1.0, 0.0])
    g_in = torch.tensor([-1.0, 1.0])  # b = -1 < 0, a = 1: conflict
    z = project_conflict(g_local, g_in)
    torch.testing.assert_close(z, torch.tensor([0.0, 1.0]))  # Eq. 13: g_in - (b/a) g_local = [-1,1] + [1,0]
    assert float(torch.dot(z, g_local)) == pytest.approx(0.0)  # the constraint of Eq. 10 is tight
    torch.testing.assert_close(alleviate(g_local, g_in, "projection"), torch.tensor([1.0, 1.0]))  # g_local + z


def test_projection_keeps_g_in_when_gradients_agree():
    g_local, g_in = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 3.0])  # b = 2 >= 0
    torch.testing.assert_close(project_conflict(g_local, g_in), g_in)
    torch.testing.assert_close(alleviate(g_local, g_in, "projection"), torch.tensor([3.0, 3.0]))


def test_simplified_update_is_g_in_plus_half_lambda_g_local():
    g_local, g_in = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1.0])
    torch.testing.assert_close(alleviate(g_local, g_in, "simplified"), torch.tensor([-0.5, 1.0]))  # lambda = 1
    torch.testing.assert_close(alleviate(g_local, g_in, "simplified", lam=4.0), torch.tensor([1.0, 1.0]))
    g_in2 = torch.tensor([1.0, 3.0])  # the simplified form adds g_local even without conflict
    torch.testing.assert_close(alleviate(g_local, g_in2, "simplified"), torch.tensor([1.5, 3.0]))


def test_proximal_gradient_is_mu_times_the_distance():
    model = torch.nn.Linear(3, 2)
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model.weight.add_(1.0)
        model.bias.sub_(2.0)
    proximal_term(model, anchor, mu_half=0.05).backward()
    torch.testing.assert_close(model.weight.grad, torch.full((2, 3), 0.1))  # 2 * 0.05 * (+1)
    torch.testing.assert_close(model.bias.grad, torch.full((2,), -0.2))
    assert float(proximal_term(model, anchor, 0.05).detach()) == pytest.approx(0.05 * (6 * 1 + 2 * 4))


# --- aggregation ------------------------------------------------------------------------------
def test_layerwise_averaging_of_three_depths_with_uneven_counts():
    s = make_server()
    s.begin_round(1)
    for cid, value in (("c0", 1.0), ("c1", 2.0), ("c2", 4.0)):
        assert s.receive(upload(s, cid, value)).status == "accepted"
    s.close_round(1)
    w10, w14, w18 = (s.arch_weights[arch(m)] for m in ("resnet10", "resnet14", "resnet18"))
    common = "intermediate.0.0.conv1.weight"  # stage 1, block 0: in every depth
    expect_all = (1 * 10 + 2 * 30 + 4 * 60) / 100
    for w in (w10, w14, w18):
        assert float(w[common].flatten()[0]) == pytest.approx(expect_all)
        assert float(w["head.weight"][0, 0]) == pytest.approx(expect_all)
    in_14_and_18 = "intermediate.2.1.conv1.weight"  # stage 3, block 1: ResNet14 [1,1,2,2] and ResNet18
    assert in_14_and_18 not in w10
    assert float(w14[in_14_and_18].flatten()[0]) == pytest.approx((2 * 30 + 4 * 60) / 90)
    only_18 = "intermediate.0.1.conv1.weight"  # stage 1, block 1: ResNet18 only
    assert only_18 not in w14 and float(w18[only_18].flatten()[0]) == pytest.approx(4.0)
    # batch-norm running statistics are averaged like weights; the batch counter takes the max
    assert float(w10["extractor.1.running_mean"][0]) == pytest.approx(expect_all)


def test_strict_aggregation_never_mixes_architectures():
    s = make_server(models=("resnet10", "resnet10", "resnet18"), counts=(10, 30, 60), aggregation="strict")
    before18 = {k: v.clone() for k, v in s.arch_weights[arch("resnet18")].items()}
    s.begin_round(1)
    s.receive(upload(s, "c0", 1.0))
    s.receive(upload(s, "c1", 5.0))
    s.close_round(1)
    w10 = s.arch_weights[arch("resnet10")]
    assert float(w10["head.weight"][0, 0]) == pytest.approx((10 + 150) / 40)
    assert all(torch.equal(v, before18[k]) for k, v in s.arch_weights[arch("resnet18")].items())


def test_layerwise_average_skips_same_name_with_another_shape():
    targets = {"a": {"w": torch.zeros(2)}, "b": {"w": torch.zeros(3)}}
    out = layerwise_average(targets, [({"w": torch.ones(2)}, 1.0), ({"w": torch.full((3,), 7.0)}, 1.0)])
    torch.testing.assert_close(out["a"]["w"], torch.ones(2))
    torch.testing.assert_close(out["b"]["w"], torch.full((3,), 7.0))


def test_shared_layers_start_equal_across_depths():
    s = make_server()
    d10, d18 = s.downlink(1, "c0").tensors, s.downlink(1, "c2").tensors
    shared = [k for k in d10 if k in d18 and d10[k].shape == d18[k].shape]
    assert "extractor.0.weight" in shared and "intermediate.3.0.conv1.weight" in shared
    assert all(torch.equal(d10[k], d18[k]) for k in shared)


# --- feature pairs ----------------------------------------------------------------------------
def test_pair_signature_rule():
    infos = [
        ClientInfo("r10", arch("resnet10"), "resnet10", dict(RES), 10, input_shape=SHAPE),
        ClientInfo("r26", arch("resnet26"), "resnet26", dict(RES), 10, input_shape=SHAPE),
        ClientInfo("r18w", arch("resnet18", width=0.125), "resnet18", {**RES, "width": 0.125}, 10, input_shape=SHAPE),
        ClientInfo("cnn", "fedhe-cnn-0(width=0.125)", "fedhe-cnn-0", {"width": 0.125}, 10, input_shape=SHAPE),
    ]
    s = FedINServer(infos, FedINOptions(), seed=0, num_classes=4, input_shape=SHAPE)
    sig = {c: s.signature[s.clients[c].arch] for c in s.clients}
    assert sig["r10"] == sig["r26"] == ((4, 4, 4), (32,))  # depth does not matter at one width and stem
    assert sig["r18w"] != sig["r10"] and sig["cnn"] != sig["r10"]
    # a pair batch of another signature is refused with the shapes in the reason
    s.begin_round(1)
    bad = upload(s, "r10", 1.0)
    bad.tensors[PAIRS_PREFIX + "s_in"] = torch.zeros(16, 8, 4, 4)
    receipt = s.receive(bad)
    assert receipt.status == "rejected" and "do not fit" in receipt.reason


def client(model: str = "resnet10", **options) -> FedINClient:
    torch.manual_seed(0)
    x, y = torch.rand(48, *SHAPE), torch.arange(48) % 4
    setup = ClientSetup("c0", arch(model), build_model(model, num_classes=4, input_shape=SHAPE, **RES), x, y, 4,
                        TrainSettings(epochs=1, batch_size=16, optimizer="adam", lr=1e-3), seed=0)
    return FedINClient(setup, FedINOptions(**options))


def test_pairs_round_trip_through_messages_and_come_back_as_S():
    s = make_server()
    s.begin_round(1)
    c = client()
    down = decode(encode(s.downlink(1, "c0")))
    assert PAIRS_PREFIX + "s_in" not in down.tensors  # initial training: no pairs yet
    up = decode(encode(c.fit(down, 1)))
    assert tuple(up.tensors[PAIRS_PREFIX + "s_in"].shape) == (16, 4, 4, 4)
    assert tuple(up.tensors[PAIRS_PREFIX + "s_out"].shape) == (16, 32)
    up.sender = "c0"
    assert s.receive(up).status == "accepted"
    s.close_round(1)
    down2 = decode(encode(s.downlink(2, "c2")))  # a ResNet18 receives the ResNet10's pairs
    torch.testing.assert_close(down2.tensors[PAIRS_PREFIX + "s_out"].sort(0).values, up.tensors[PAIRS_PREFIX + "s_out"].sort(0).values)


@pytest.mark.parametrize("mode", ["simplified", "projection", "none"])
def test_in_training_pulls_intermediate_layers_toward_the_pairs(mode):
    # pairs from a fixed random "teacher" intermediate block: training with them lowers the IN loss
    teacher = build_model("resnet10", num_classes=4, input_shape=SHAPE, **RES).eval()
    with torch.no_grad():
        s_in = torch.rand(16, 4, 4, 4)
        s_out = teacher.intermediate(s_in)
    weights = client().model.state_dict()
    down = Message("weights", 2, "server", {**weights, PAIRS_PREFIX + "s_in": s_in, PAIRS_PREFIX + "s_out": s_out})

    def in_loss(c: FedINClient) -> float:
        c.model.eval()
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(c.model.intermediate(s_in), s_out))

    with_in, without = client(alleviation=mode), client(in_training=False)
    with_in.setup.train.epochs = without.setup.train.epochs = 5
    with_in.fit(down, 2)
    without.fit(down, 2)
    assert in_loss(with_in) < in_loss(without)


def test_in_forward_leaves_batch_norm_statistics_alone():
    model = build_model("resnet10", num_classes=4, input_shape=SHAPE, **RES)
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    model.train()
    with _KeepBatchNormStats(model.intermediate):
        model.intermediate(torch.rand(8, 4, 4, 4) * 10)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_hostile_pairs_are_rejected():
    s = make_server()
    s.begin_round(1)
    nan = upload(s, "c0", 1.0)
    nan.tensors[PAIRS_PREFIX + "s_out"][0, 0] = float("nan")
    assert "finite" in s.receive(nan).reason
    huge = upload(s, "c1", 1.0)
    huge.tensors[PAIRS_PREFIX + "s_in"] = torch.zeros(5000, 4, 4, 4)
    huge.tensors[PAIRS_PREFIX + "s_out"] = torch.zeros(5000, 32)
    assert "pairs" in s.receive(huge).reason
    no_pairs = upload(s, "c2", 1.0)
    del no_pairs.tensors[PAIRS_PREFIX + "s_in"]
    assert s.receive(no_pairs).status == "rejected"


def upload(s: FedINServer, sender: str, value: float, round_no: int = 1) -> Message:
    arch_name = s.clients[sender].arch
    tensors = {k: torch.full_like(v, value) if v.is_floating_point() else v for k, v in s.arch_weights[arch_name].items()}
    sig_in, sig_out = s.signature[arch_name]
    tensors[PAIRS_PREFIX + "s_in"] = torch.rand(16, *sig_in)
    tensors[PAIRS_PREFIX + "s_out"] = torch.rand(16, *sig_out)
    return Message("weights", round_no, sender, tensors, {"num_samples": s.clients[sender].num_samples})


def test_fedin_simulation_on_digits_is_reproducible_and_learns():
    from edgefl.config import RunConfig
    from edgefl.sim.engine import Simulation
    from tests.conftest import digits_config

    groups = [{"model": m, "count": 2, "options": {"width": 0.125, "stem": "imagenet"}} for m in ("resnet10", "resnet14")]
    raw = digits_config("fedin", rounds=3, fleet={"groups": groups, "sample_ratio": 0.5})
    runs = [Simulation(RunConfig.model_validate(raw), show_progress=False).run() for _ in range(2)]
    assert runs[0]["final_accuracy"] == runs[1]["final_accuracy"]
    assert runs[0]["final_accuracy"]["overall"] > 0.3  # 10 classes: chance is 0.1


def test_without_in_training_no_pairs_travel():
    s = make_server(in_training=False)
    s.begin_round(1)
    c = client(in_training=False)
    up = c.fit(s.downlink(1, "c0"), 1)
    assert not any(k.startswith(PAIRS_PREFIX) for k in up.tensors)
    assert s.receive(up).status == "accepted"
    s.close_round(1)
    assert PAIRS_PREFIX + "s_in" not in s.downlink(2, "c1").tensors
