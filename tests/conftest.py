from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _few_threads():
    # Tests share a 2-core machine with whatever else runs; one thread keeps timings sane.
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _own_device_state(tmp_path, monkeypatch):
    # `edgefl client` keeps its state under $XDG_STATE_HOME: each test (and every device process
    # it starts) gets its own, so no test resumes from another's saved rounds
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    yield


def digits_config(method: str = "fedhe", rounds: int = 2, **overrides) -> dict:
    """A tiny real-data run (scikit-learn digits, 8x8) that finishes in seconds."""
    cfg = {
        "name": f"test-{method}",
        "seed": 0,
        "rounds": rounds,
        "method": {"name": method},
        "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5, "min_samples": 20},
        "train": {"epochs": 1, "batch_size": 32, "optimizer": "adam", "lr": 0.003},
        "fleet": {"groups": [
            {"model": "fedhe-cnn-0", "count": 2, "options": {"width": 0.125}},
            {"model": "mlp", "count": 2, "options": {"hidden": [32, 16]}},
        ]},
        "eval": {"every": 1},
    }
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


#: how a registered method gets a tiny digits run when the defaults do not fit it; every method in
#: edgefl.methods.METHODS runs from here (tests/test_every_method.py fails for a method whose
#: defaults cannot run and that has no recipe, which tells its author to add one)
def _features(width: int):
    def recipe(raw: dict) -> None:
        raw["method"]["feature_dim"] = width
        for g in raw["fleet"]["groups"]:
            g["options"]["feature_dim"] = width
    return recipe


def _chfl(raw: dict) -> None:
    for g in raw["fleet"]["groups"]:
        g["options"]["feature_dim"] = 64


def _resnets(raw: dict) -> None:
    raw["fleet"]["groups"] = [{"model": "resnet10", "count": 2, "options": {"width": 0.0625}},
                              {"model": "resnet14", "count": 2, "options": {"width": 0.0625}}]


def _generators(raw: dict) -> None:
    raw["method"].update(synthetic_samples=200, global_epochs=2, global_lr=1e-3)
    cvae = {"model": "cvae-small", "count": 2, "options": {"hidden": 64}}
    mlp = {"model": "mlp", "count": 2, "options": {"hidden": [32, 16]}}
    raw["fleet"]["groups"] = [cvae, {**cvae}] if raw["method"]["name"] == "fedcvae" else [mlp, cvae]
    if raw["method"]["name"] == "fedcvae":  # its server trains a VGG-9 from scratch: a narrow one (70 M weights at full width)
        raw["method"]["global_model_options"] = {"width": 0.0625}


RECIPES = {"chfl": _chfl, "felo": _features(32), "velo": _features(32), "fedin": _resnets,
           "fedmho": _generators, "fedmho-md": _generators, "fedmho-sd": _generators, "fedcvae": _generators}


def method_config(method: str, rounds: int = 2) -> dict:
    """A tiny real-data run of any registered method (one round for a one-shot method)."""
    from edgefl.methods import get_method

    spec = get_method(method)
    raw = digits_config(method, rounds=1 if spec.one_shot else rounds)
    if method in RECIPES:
        RECIPES[method](raw)
    return raw


def serve_with_device_threads(cfg, url: str, devices: list[str], join_timeout_s: float) -> tuple[dict, dict]:
    """``serve`` a fleet whose devices run ``run_device`` in threads of this process (a memory or
    test transport); returns (the server's summary, what each device served). A device that
    raised fails the test."""
    import threading

    from edgefl.fleet.launcher import run_device, serve

    served: dict[str, list] = {}
    failed: list[BaseException] = []

    def device(name: str) -> None:
        try:
            served[name] = run_device(cfg, name, url, timeout_s=120)
        except BaseException as exc:  # surfaced below
            failed.append(exc)

    threads = [threading.Thread(target=device, args=(d,), daemon=True) for d in devices]
    for t in threads:
        t.start()
    summary = serve(cfg, url, None, join_timeout_s=join_timeout_s)
    for t in threads:
        t.join(60)
    assert not failed, failed
    return summary, served


def flip_last(data: bytes) -> bytes:
    """``data`` with its last byte changed. Flipping a bit always changes it; writing a fixed byte
    does not when the byte already had that value (once in 256 runs, a flaky test)."""
    return data[:-1] + bytes([data[-1] ^ 1])
