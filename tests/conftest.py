from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _few_threads():
    # Tests share a 2-core machine with whatever else runs; one thread keeps timings sane.
    torch.set_num_threads(1)
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
