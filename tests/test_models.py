"""Every zoo builder: forward, backward, the split composing to the whole, metadata."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from edgefl.errors import ConfigError
from edgefl.models import SplitClassifier, build_model, get_spec, model_info, model_names
from edgefl.models.resnet import build_resnet

# Reduced widths keep the suite fast; the structure (and so the split) does not depend on width.
SMALL = {"resnet": {"width": 0.125}, "vgg": {"width": 0.0625}, "fedhe-cnn": {"width": 0.25}, "cvae": {}}


def small_options(name: str) -> dict:
    spec = get_spec(name)
    if name == "cvae-large":
        return {"width": 0.125}
    return dict(SMALL.get(spec.family, {}))


@pytest.mark.parametrize("name", model_names("classifier"))
def test_classifier_forward_backward_and_split(name):
    torch.manual_seed(0)
    shape = (30,) if name == "mlp" else (1, 28, 28)
    model = build_model(name, num_classes=7, input_shape=shape, **small_options(name))
    assert isinstance(model, SplitClassifier)
    x = torch.rand(4, *shape)
    logits = model(x)
    assert logits.shape == (4, 7)
    F.cross_entropy(logits, torch.tensor([0, 1, 2, 3])).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()  # dropout off: the composed pass must equal the whole, bit for bit
    feats = model.intermediate(model.extractor(x))
    assert feats.shape == (4, model.feature_dim)
    assert torch.equal(model.head(feats), model(x))
    logits2, feats2 = model.forward_with_features(x)
    assert torch.equal(logits2, model(x)) and torch.equal(feats2, feats)


@pytest.mark.parametrize("depth", ["resnet10", "resnet14", "resnet18", "resnet22", "resnet26", "resnet34", "resnet50"])
@pytest.mark.parametrize("stem", ["small", "imagenet"])
def test_resnet_split_equals_torchvision_forward(depth, stem):
    torch.manual_seed(0)
    split, reference = build_resnet(depth, 10, (1, 32, 32), width=0.125, stem=stem, return_reference=True)
    split.eval(), reference.eval()
    x = torch.rand(3, 1, 32, 32)
    assert torch.equal(split(x), reference(x))


def test_resnet_block_counts_and_width():
    blocks = lambda m: [len(stage) for stage in list(m.intermediate)[:4]]  # noqa: E731
    assert blocks(build_model("resnet10", width=0.125)) == [1, 1, 1, 1]
    assert blocks(build_model("resnet14", width=0.125)) == [1, 1, 2, 2]
    assert blocks(build_model("resnet26", width=0.125)) == [3, 3, 3, 3]
    full, quarter = model_info("resnet18"), model_info("resnet18", width=0.25)
    assert full.feature_dim == 512 and quarter.feature_dim == 128
    assert quarter.params < full.params / 10
    # common layers of different depths share names: what layer-wise aggregation relies on
    names10 = set(build_model("resnet10", width=0.125).state_dict())
    names18 = set(build_model("resnet18", width=0.125).state_dict())
    assert names10 < names18


def test_feature_dim_projection_gives_common_width():
    for name in ("lenet5", "fedhe-cnn-3", "resnet10"):
        m = build_model(name, **small_options(name), feature_dim=64)
        assert m.feature_dim == 64 and m.features(torch.rand(2, 1, 28, 28)).shape == (2, 64)


@pytest.mark.parametrize("name", ["cvae-small", "cvae-large"])
@pytest.mark.parametrize("size", [28, 32])
def test_cvae_forward_backward_and_decoder(name, size):
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, input_shape=(1, size, size), **small_options(name))
    x = torch.rand(4, 1, size, size)
    y = F.one_hot(torch.tensor([0, 3, 5, 9]), 10).float()
    recon, mu, logvar = model(x, y)
    assert recon.shape == x.shape and mu.shape == (4, 20)
    loss = model.loss(recon, x, mu, logvar)
    loss.backward()
    assert torch.isfinite(loss)
    sample = model.decoder(torch.randn(4, 20), y)
    assert sample.shape == x.shape and float(sample.min()) >= 0 and float(sample.max()) <= 1
    assert get_spec(name).kind == "generator"


def test_measured_flops_match_fedmho_table_ii():
    # FedMHO Table II counts multiply-adds; torch's counter counts 2 FLOPs per multiply-add.
    assert model_info("vgg9").flops_per_sample / 2 == pytest.approx(126.47e6, rel=0.01)
    assert model_info("cnn-small").flops_per_sample / 2 == pytest.approx(467e3, rel=0.01)
    assert model_info("vgg9").params == pytest.approx(69e6, rel=0.01)


def test_fedhe_cnn_table_ii_filters():
    m = build_model("fedhe-cnn-4")
    convs = [mod for mod in m.modules() if isinstance(mod, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [256, 512]
    m9 = build_model("fedhe-cnn-9")
    assert [c.out_channels for c in m9.modules() if isinstance(c, torch.nn.Conv2d)] == [128, 128, 198]
    assert m9.head.bias is None  # last layer dense without bias


def test_unknown_model_suggests_nearest():
    with pytest.raises(ConfigError, match="resnet18"):
        build_model("resnet19")
