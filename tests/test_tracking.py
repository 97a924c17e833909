"""TensorBoard and MLflow get every round's numbers, read back through their own libraries."""

from __future__ import annotations

import pytest

from edgefl.config import validate_config
from edgefl.rundir import RunDir
from edgefl.sim import Simulation
from tests.conftest import digits_config


def test_a_run_feeds_tensorboard_and_mlflow_and_both_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = validate_config({**digits_config("fedavg", rounds=3), "track": ["tensorboard", "mlflow"]})
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    summary = Simulation(cfg, run, show_progress=False).run()
    history = [m["accuracy"]["overall"] for m in run.metrics()]

    events = EventAccumulator(str(run.path / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("accuracy/overall")]
    assert [s for s, _ in logged] == [1, 2, 3]
    assert [v for _, v in logged] == pytest.approx(history, abs=1e-6)
    assert "comm/bytes_up" in events.Tags()["scalars"]

    client = MlflowClient((run.path / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == cfg.name]
    (mlrun,) = client.search_runs([experiment.experiment_id])
    assert mlrun.info.status == "FINISHED"
    metric = client.get_metric_history(mlrun.info.run_id, "accuracy.overall")
    assert [m.step for m in metric] == [1, 2, 3]
    assert [m.value for m in metric] == pytest.approx(history, abs=1e-6)
    assert mlrun.data.params["method.name"] == "fedavg" and mlrun.data.params["seed"] == "0"
    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id)}
    assert {"summary.json", "plots"} <= artifacts
    assert summary["final_accuracy"]["overall"] == pytest.approx(history[-1])
