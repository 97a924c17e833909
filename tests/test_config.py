"""Config validation: every mistake names its key and suggests the nearest valid one."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefl.config import PRESETS, apply_overrides, load_config, parse_value, validate_config
from edgefl.errors import ConfigError
from tests.conftest import digits_config

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.toml"))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_validate(preset):
    cfg = load_config(None, preset=preset)
    # the demo is FedAvg-groups on three architectures with its Local-only baseline (benchmark 19); the paper presets are FedHe's
    assert cfg.method.name == ("fedavg" if preset == "demo" else "fedhe") and cfg.fleet.num_clients == 10
    assert (cfg.simulation.baseline == "local") == (preset == "demo")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path):
    load_config(path)


def test_examples_exist():
    assert len(EXAMPLES) >= 3


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as exc:
        validate_config(raw, "test.toml")
    return str(exc.value)


def test_unknown_key_suggests_nearest():
    raw = digits_config()
    raw["data"]["partiton"] = "iid"
    assert "data.partiton: unknown key (did you mean 'partition'?)" in _error(raw)
    raw = digits_config()
    raw["roundz"] = 3
    assert "roundz: unknown key (did you mean 'rounds'?)" in _error(raw)
    raw = digits_config()
    raw["fleet"]["groups"][0]["cuont"] = 3
    assert "fleet.groups[0].cuont: unknown key (did you mean 'count'?)" in _error(raw)


def test_wrong_type_names_key():
    raw = digits_config()
    raw["train"]["lr"] = "fast"
    assert "train.lr" in _error(raw)
    raw = digits_config()
    raw["rounds"] = 0
    assert "rounds: Input should be greater than or equal to 1" in _error(raw)


def test_unknown_model_dataset_method_and_option():
    raw = digits_config()
    raw["fleet"]["groups"][0]["model"] = "resnet19"
    assert "unknown model 'resnet19' (did you mean 'resnet18'?)" in _error(raw)
    raw = digits_config()
    raw["data"]["dataset"] = "fashion_mnist"
    assert "did you mean 'fashion-mnist'?" in _error(raw)
    raw = digits_config()
    raw["fleet"]["groups"][0]["options"] = {"widht": 0.5}
    assert "no option 'widht' (did you mean 'width'?)" in _error(raw)
    raw = digits_config(method="fedhee")
    with pytest.raises(ConfigError, match="did you mean 'fedhe'"):
        validate_config(raw)


def test_method_options_are_validated_by_the_method():
    raw = digits_config()
    raw["method"]["alpah"] = 1.0
    assert "method.alpah: unknown key (did you mean 'alpha'?)" in _error(raw)
    raw = digits_config()
    raw["method"]["logit_loss"] = "l1"
    assert "method.logit_loss" in _error(raw)
    raw = digits_config("local")
    raw["method"]["alpha"] = 1.0  # an option of another method
    assert "method 'local' takes these options: none" in _error(raw)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = [1,\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_overrides():
    raw = apply_overrides(digits_config(), ["rounds=5", "data.partition=iid", "fleet.groups.1.count=4", "method.alpha=0.5"])
    cfg = validate_config(raw)
    assert cfg.rounds == 5 and cfg.data.partition == "iid" and cfg.fleet.groups[1].count == 4
    assert cfg.method.options() == {"alpha": 0.5}
    assert parse_value("[1, 2]") == [1, 2] and parse_value("true") is True and parse_value("hello") == "hello"
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["rounds"])
    with pytest.raises(ConfigError, match="no item 9"):
        apply_overrides(digits_config(), ["fleet.groups.9.count=1"])
    with pytest.raises(ConfigError, match="numbered as parts of the path") as caught:  # the habit an outside trial had
        apply_overrides(digits_config(), ["fleet.groups[1].count=4"])
    assert caught.value.hint == "--set fleet.groups.1.count=4"


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = validate_config(digits_config())
    path = tmp_path / "config.toml"
    path.write_text(cfg.to_toml())
    again = load_config(path)
    assert again.to_dict() == cfg.to_dict()


def test_per_group_train_override():
    raw = digits_config()
    raw["fleet"]["groups"][0]["train"] = {"epochs": 3}
    cfg = validate_config(raw)
    assert cfg.train_for(cfg.fleet.groups[0]).epochs == 3
    assert cfg.train_for(cfg.fleet.groups[0]).lr == cfg.train.lr
    assert cfg.train_for(cfg.fleet.groups[1]).epochs == 1


def test_config_differences_name_the_leaf_that_differs():
    """One comparison serves resume refusals, bench paper --merge and kept clients: it names leaves,
    a table one side lacks by its leaves, and lists item by item only when asked."""
    from edgefl.configtools import config_differences

    saved = {"rounds": 3, "fleet": {"groups": [{"count": 2}, {"count": 3}]}, "method": {"options": {}}}
    now = {"rounds": 4, "fleet": {"groups": [{"count": 2}, {"count": 5}]}, "extra": {"a": 1}}
    assert config_differences(saved, now) == [("extra.a", None, 1), ("fleet.groups", saved["fleet"]["groups"], now["fleet"]["groups"]),
                                              ("rounds", 3, 4)]
    assert [k for k, _, _ in config_differences(saved, now, into_lists=True)] == ["extra.a", "fleet.groups.1.count", "rounds"]
    assert config_differences(saved, saved) == [] and config_differences(1, 2) == [("(config)", 1, 2)]
