"""Which model a phone gets from a run (ship.json) and what `edgefl export RUN_DIR` exports by default."""

from __future__ import annotations

import json

import pytest

from edgefl.config import RunConfig
from edgefl.errors import EdgeflError
from edgefl.exporters.source import sources_from_path
from edgefl.rundir import RunDir
from edgefl.sim import Simulation
from tests.conftest import digits_config


def _run(tmp_path, method: str, **data):
    raw = digits_config(method, rounds=1)
    raw["fleet"]["groups"][0]["count"] = 3
    raw["data"].update(data)
    run = RunDir.create(tmp_path / method, raw["name"], 0)
    Simulation(RunConfig.model_validate(raw), run, show_progress=False).run()
    return run.path, json.loads((run.path / "ship.json").read_text())


def test_a_per_device_method_ships_the_best_device_of_each_architecture_and_exports_only_that(tmp_path):
    path, plan = _run(tmp_path, "fedhe")
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    reported = records[-1]["accuracy"]["per_client"]
    assert plan["kind"] == "best device per architecture" and set(plan["models"]) == {"fedhe-cnn-0(width=0.125)", "mlp(hidden=[32, 16])"}
    cnn = plan["models"]["fedhe-cnn-0(width=0.125)"]
    members = ["client-0", "client-1", "client-2"]
    assert cnn["device"] == max(members, key=lambda d: reported[d]) and cnn["accuracy"] == reported[cnn["device"]]
    assert (path / cnn["file"]).is_file() and "best of the 3 device(s)" in cnn["why"]
    test_used = json.loads((path / "run.json").read_text())["dataset"]["test_used"]
    assert cnn["judged_on"] == f"the shared test set ({test_used} samples)" and cnn["judged_on"] in cnn["why"]
    assert set(plan["phones"]) == {"android-midrange", "iphone-15"}
    assert all(p["arch"] in plan["models"] for p in plan["phones"].values())
    assert all(p["device"] == plan["models"][p["arch"]]["device"] for p in plan["phones"].values())  # whose model it is
    assert plan["dataset"] == "digits"  # what `edgefl export` of a device's own file is given (--dataset)
    shipped = sources_from_path(path)
    assert sorted(s.name for s in shipped) == sorted(f"ship-{n}" for n in ("fedhe-cnn-0_width_0.125", "mlp_hidden__32__16"))
    assert len(sources_from_path(path, every=True)) == 5 + 2  # five devices' private models and the two shipped
    summary = json.loads((path / "summary.json").read_text())
    assert summary["ship"]["models"].keys() == plan["models"].keys()
    assert summary["final_accuracy"]["judged_on"].startswith("shared test set")


def test_a_method_with_global_models_ships_them(tmp_path):
    path, plan = _run(tmp_path, "fedavg")
    assert plan["kind"] == "global"
    assert all(m["file"].startswith("models/global-") and (path / m["file"]).is_file() for m in plan["models"].values())
    assert all(s.name.startswith("global-") for s in sources_from_path(path))
    per_arch = json.loads((path / "summary.json").read_text())["final_accuracy"]["per_arch"]
    assert {a: m["accuracy"] for a, m in plan["models"].items()} == per_arch  # what a phone's pick is weighed by
    assert all(p["accuracy"] == per_arch[p["arch"]] for p in plan["phones"].values())


def test_a_local_fleet_adopts_the_devices_readable_model_files_and_skips_a_damaged_one_with_a_line(tmp_path, caplog):
    import logging
    import shutil

    from edgefl.device_state import MODEL
    from edgefl.server.shipping import adopt_device_models

    path, plan = _run(tmp_path, "fedhe")
    cnn_arch = "fedhe-cnn-0(width=0.125)"
    best = plan["models"][cnn_arch]["device"]
    other = next(d for d in ("client-0", "client-1", "client-2") if d != best)
    # as a fleet's server leaves it: no device's weights in the run directory, ship.json says where they are
    kept = {d: (path / "models" / f"{d}-fedhe-cnn-0_width_0.125.safetensors").read_bytes() for d in (best, other)}
    for model in (path / "models").iterdir():
        model.unlink()
    for entry in plan["models"].values():
        entry["file"], entry["where"] = None, "on the device"
    (path / "ship.json").write_text(json.dumps(plan))
    # what `edgefl export RUN_DIR` says of a real fleet's run: where the models are, not "not a finished run"
    with pytest.raises(EdgeflError, match="keeps one on each device") as caught:
        sources_from_path(path)
    assert f"{cnn_arch}: {best}" in caught.value.message
    assert "edgefl export STATE_DIR/model.safetensors --dataset digits" in caught.value.hint  # ship.json names the data set
    states = {d: tmp_path / "state" / d for d in (best, other)}
    for device, folder in states.items():
        folder.mkdir(parents=True)
        (folder / MODEL).write_bytes(kept[device])
    (states[other] / MODEL).write_bytes(kept[other][: len(kept[other]) // 3])  # cut short: a power cut mid-copy
    with caplog.at_level(logging.WARNING):
        written = adopt_device_models(RunDir(path), states)
    assert f"{other}: its model file" in caplog.text and "unreadable" in caplog.text
    assert sorted(written) == sorted([f"models/{best}-fedhe-cnn-0_width_0.125.safetensors",
                                      "models/ship-fedhe-cnn-0_width_0.125.safetensors"])
    adopted = json.loads((path / "ship.json").read_text())["models"][cnn_arch]
    assert adopted["file"] == "models/ship-fedhe-cnn-0_width_0.125.safetensors" and "where" not in adopted
    assert (path / adopted["file"]).read_bytes() == kept[best]
    assert json.loads((path / "summary.json").read_text())["ship"]["models"][cnn_arch]["file"] == adopted["file"]
    shutil.rmtree(states[best])  # a fleet of devices that kept nothing: nothing to adopt, nothing written
    (path / "models" / f"{best}-fedhe-cnn-0_width_0.125.safetensors").unlink()
    assert adopt_device_models(RunDir(path), {best: states[best]}) == []


def test_a_local_fleet_whose_best_device_left_no_model_ships_the_next_best_that_did_and_says_so(tmp_path):
    from edgefl.device_state import MODEL
    from edgefl.server.shipping import adopt_device_models

    path, plan = _run(tmp_path, "fedhe")
    cnn_arch, file_arch = "fedhe-cnn-0(width=0.125)", "fedhe-cnn-0_width_0.125"
    ranked = plan["models"][cnn_arch]["ranked"]
    assert [r["device"] for r in ranked][0] == plan["models"][cnn_arch]["device"] and len(ranked) == 3
    assert [r["accuracy"] for r in ranked] == sorted((r["accuracy"] for r in ranked), reverse=True)
    best, second = ranked[0]["device"], ranked[1]["device"]
    kept = (path / "models" / f"{second}-{file_arch}.safetensors").read_bytes()
    for model in (path / "models").iterdir():
        model.unlink()
    for entry in plan["models"].values():
        entry["file"], entry["where"] = None, "on the device"
    (path / "ship.json").write_text(json.dumps(plan))
    # the best device died before the run ended (an asynchronous fleet): its folder holds no final model
    states = {best: tmp_path / "state" / best, second: tmp_path / "state" / second}
    for folder in states.values():
        folder.mkdir(parents=True)
    (states[second] / MODEL).write_bytes(kept)
    written = adopt_device_models(RunDir(path), states)
    assert f"models/ship-{file_arch}.safetensors" in written
    adopted = json.loads((path / "ship.json").read_text())["models"][cnn_arch]
    assert adopted["device"] == second and adopted["accuracy"] == ranked[1]["accuracy"]
    assert f"{best}, the best that reported, left no final model" in adopted["why"] and second in adopted["why"]
    assert (path / adopted["file"]).read_bytes() == kept
    phones = json.loads((path / "ship.json").read_text())["phones"]
    assert all(p["device"] == second for p in phones.values() if p["arch"] == cnn_arch)


def test_a_phone_gets_the_most_accurate_shipped_model_that_fits_it_not_merely_the_largest():
    from edgefl.build import build_run
    from edgefl.server.shipping import _phones

    cfg = RunConfig.model_validate(digits_config("fedavg", rounds=1))
    parts = build_run(cfg)
    cnn, mlp = "fedhe-cnn-0(width=0.125)", "mlp(hidden=[32, 16])"

    def shipped(cnn_acc, mlp_acc):
        return {cnn: {"file": "models/global-cnn.safetensors", "accuracy": cnn_acc},
                mlp: {"file": "models/global-mlp.safetensors", "accuracy": mlp_acc}}

    unmeasured = _phones(cfg, parts.ds, shipped(None, None), parts.slots)
    largest = unmeasured["android-midrange"]["largest_that_fits"]
    assert all(p["arch"] == p["largest_that_fits"] == largest and p["accuracy"] is None for p in unmeasured.values())
    assert largest == cnn  # both fit a phone; the CNN has the more FLOPs
    # the smaller model ended more accurate (a group with less data): the phone gets it, and the plan says why
    better_small = _phones(cfg, parts.ds, shipped(0.61, 0.83), parts.slots)["android-midrange"]
    assert better_small["arch"] == mlp and better_small["file"] == "models/global-mlp.safetensors"
    assert better_small["accuracy"] == 0.83 and better_small["largest_that_fits"] == cnn
    assert "most accurate of the 2 shipped models that fit" in better_small["why"] and "0.6100" in better_small["why"]
    # a tie keeps the larger; the larger being better keeps assign's reason and says it is also the best
    tie = _phones(cfg, parts.ds, shipped(0.8, 0.8), parts.slots)["android-midrange"]
    assert tie["arch"] == cnn and "also the most accurate" in tie["why"] and tie["why"].startswith("edgefl assign: ")


def test_a_best_device_picked_on_its_own_held_out_samples_says_how_many(tmp_path):
    path, plan = _run(tmp_path, "fedhe", client_test_fraction=0.3)
    held_out = {c["client_id"]: c["num_test"] for c in json.loads((path / "partition.json").read_text())["clients"]}
    for entry in plan["models"].values():
        held = held_out[entry["device"]]
        assert entry["judged_on"] == f"its {held} held-out samples" and f"on its {held} held-out samples" in entry["why"]
