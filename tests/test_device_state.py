"""A device's saved state (docs/PROTOCOL.md section 9): a changed config or a new run starts the
device afresh, the old state moved aside (never deleted) with a log line; state of another device
is refused with what to do."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from edgefl.device_state import CARRY, EXPORT, MODEL, OLD, STATE_JSON, UPLOAD, DeviceStateStore
from edgefl.errors import EdgeflError
from edgefl.transport.envelope import Envelope, pack


#: the last upload a device keeps: a whole envelope, as it sent it (the store checks it on load)
UPLOADED = pack(Envelope("upload", "fed", 2, "client-0", b"body", message_id="m-2", model_version=2))


def _save(directory, run: str = "run-a", config: str = "a" * 64, device: str = "client-0", round_no: int = 2) -> DeviceStateStore:
    store = DeviceStateStore(directory, device, "fed", config)
    store.save(round_no, run, {"w": torch.ones(2)}, UPLOADED)
    return store


def _kept(directory) -> list:
    return sorted(p for p in (directory / OLD).iterdir()) if (directory / OLD).is_dir() else []


def test_state_of_the_same_config_is_loaded_and_nothing_is_moved(tmp_path):
    _save(tmp_path)
    round_no, run, tensors, upload = DeviceStateStore(tmp_path, "client-0", "fed", "a" * 64).load()
    assert (round_no, run, upload) == (2, "run-a", UPLOADED) and torch.equal(tensors["w"], torch.ones(2))
    assert _kept(tmp_path) == []


def test_a_changed_config_starts_afresh_and_keeps_the_old_state_aside(tmp_path, caplog):
    _save(tmp_path, config="a" * 64)
    store = DeviceStateStore(tmp_path, "client-0", "fed", "b" * 64)
    with caplog.at_level(logging.WARNING, logger="edgefl.device"):
        assert store.load() is None  # afresh, where it used to refuse to start
    (kept,) = _kept(tmp_path)
    assert {p.name for p in kept.iterdir()} == {STATE_JSON, CARRY, UPLOAD}
    assert json.loads((kept / STATE_JSON).read_text())["config_sha256"] == "a" * 64
    assert not (tmp_path / STATE_JSON).exists()
    assert "config_sha256 differ" in caplog.text and str(kept) in caplog.text and "starts afresh" in caplog.text
    store.save(1, "run-b", {"w": torch.zeros(2)}, UPLOADED)  # the new config's rounds are saved as usual
    assert store.load()[:2] == (1, "run-b") and len(_kept(tmp_path)) == 1


def test_another_federation_is_another_config(tmp_path):
    _save(tmp_path)
    assert DeviceStateStore(tmp_path, "client-0", "other-fed", "a" * 64).load() is None
    assert len(_kept(tmp_path)) == 1


def test_a_new_run_keeps_the_old_runs_state_aside_when_it_saves_its_first_round(tmp_path, caplog):
    _save(tmp_path, run="run-a", round_no=3)
    store = DeviceStateStore(tmp_path, "client-0", "fed", "a" * 64)
    assert store.load()[1] == "run-a"  # loaded: the device applies it only if the server runs run-a
    with caplog.at_level(logging.WARNING, logger="edgefl.device"):
        store.save(1, "run-b", {"w": torch.zeros(2)}, b"round 1 of run-b")
    (kept,) = _kept(tmp_path)
    assert json.loads((kept / STATE_JSON).read_text())["run"] == "run-a" and (kept / UPLOAD).read_bytes() == UPLOADED
    assert json.loads((tmp_path / STATE_JSON).read_text())["run"] == "run-b"
    assert "another run (run-a, not run-b)" in caplog.text
    store.save(2, "run-b", {"w": torch.zeros(2)}, b"round 2 of run-b")  # later rounds of the same run overwrite as before
    assert len(_kept(tmp_path)) == 1


def test_the_model_of_a_finished_run_is_kept_aside_with_its_state_when_the_next_run_starts(tmp_path):
    from edgefl.rundir import load_model_file

    store = _save(tmp_path, run="run-a", round_no=3)
    path = store.save_model({"w": torch.full((2,), 7.0)}, {"model": "mlp", "round": 3, "run": "run-a"})
    tensors, meta = load_model_file(path)  # the format of a run directory's model files (edgefl export reads it)
    assert path == tmp_path / MODEL and torch.equal(tensors["w"], torch.full((2,), 7.0)) and meta["run"] == "run-a"
    # its phone files where `edgefl export STATE_DIR/model.safetensors` puts them by default
    from edgefl.exporters import default_out_dir

    assert default_out_dir(path) == tmp_path / EXPORT
    (tmp_path / EXPORT).mkdir()
    (tmp_path / EXPORT / "model.onnx").write_bytes(b"onnx of run-a")
    store = DeviceStateStore(tmp_path, "client-0", "fed", "a" * 64)
    store.load()
    store.save(1, "run-b", {"w": torch.zeros(2)}, b"round 1 of run-b")
    (kept,) = _kept(tmp_path)
    assert {p.name for p in kept.iterdir()} == {STATE_JSON, CARRY, UPLOAD, MODEL, EXPORT} and not (tmp_path / MODEL).exists()
    # the export goes with the model it was made from, not left to describe a model no longer there
    assert (kept / EXPORT / "model.onnx").read_bytes() == b"onnx of run-a" and not (tmp_path / EXPORT).exists()


def test_the_same_run_continuing_overwrites_its_own_state(tmp_path):
    _save(tmp_path, run="run-a", round_no=3)
    store = DeviceStateStore(tmp_path, "client-0", "fed", "a" * 64)
    store.load()
    store.save(4, "run-a", {"w": torch.zeros(2)}, UPLOADED)
    assert _kept(tmp_path) == [] and store.load()[0] == 4


def test_two_set_asides_in_one_second_keep_both(tmp_path):
    for config in ("a", "b", "c"):
        _save(tmp_path, config=config * 64)
        DeviceStateStore(tmp_path, "client-0", "fed", "z" * 64).load()
    assert len(_kept(tmp_path)) == 3


def test_state_of_another_device_is_refused_with_what_to_do(tmp_path):
    _save(tmp_path, device="client-1")
    with pytest.raises(EdgeflError, match="belongs to device 'client-1', not 'client-0'") as caught:
        DeviceStateStore(tmp_path, "client-0", "fed", "a" * 64).load()
    assert "its own --state-dir" in str(caught.value)
    assert (tmp_path / STATE_JSON).exists() and _kept(tmp_path) == []  # nothing moved: it is client-1's


@pytest.mark.parametrize("damage", ["carry", "state", "upload"])
def test_damaged_state_is_kept_aside_and_the_device_starts_afresh_instead_of_failing_at_every_restart(tmp_path, caplog, damage):
    _save(tmp_path)
    if damage == "carry":  # cut short (a power cut mid-write of the file system)
        data = (tmp_path / CARRY).read_bytes()
        (tmp_path / CARRY).write_bytes(data[: len(data) // 2])
    elif damage == "upload":  # overwritten: found now, not blamed on the server's first message later
        (tmp_path / UPLOAD).write_bytes(os.urandom(20))
    else:
        (tmp_path / STATE_JSON).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="edgefl.device"):
        assert DeviceStateStore(tmp_path, "client-0", "fed", "a" * 64).load() is None
    (kept,) = _kept(tmp_path)
    assert {p.name for p in kept.iterdir()} == {STATE_JSON, CARRY, UPLOAD}
    assert "cannot be read" in caplog.text and "starts afresh" in caplog.text
    # it says what was lost: the server sees only a device that starts over
    assert "rounds in it are lost" in caplog.text and "check the storage" in caplog.text
    if damage == "carry":  # state.json was read: the round and run it held are named
        assert "(after round 2 of run run-a) cannot be read (carry.safetensors: " in caplog.text
    elif damage == "upload":
        assert "(after round 2 of run run-a) cannot be read (upload.edfl: " in caplog.text
    else:  # the file is named whichever one was damaged
        assert STATE_JSON in caplog.text


def test_a_state_folder_that_refuses_writes_is_one_error_with_what_to_do(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import edgefl.device_state as device_state
    import edgefl.rundir as rundir

    def refuse(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 1, kind: PermissionDenied })")

    monkeypatch.setattr(device_state, "save_file", refuse)
    monkeypatch.setattr(rundir, "save_file", refuse)  # the model file's writer
    store = DeviceStateStore(tmp_path, "client-0", "fed", "a" * 64)
    for save in (lambda: store.save(1, "run-a", {"w": torch.ones(2)}, b"x"), lambda: store.save_model({"w": torch.ones(2)}, {})):
        with pytest.raises(EdgeflError) as caught:
            save()
        assert "PermissionDenied" in str(caught.value) and "writable --state-dir" in caught.value.hint


def test_a_device_without_a_state_folder_says_at_the_end_that_its_model_was_not_kept():
    from types import SimpleNamespace

    from edgefl.fleet.launcher import save_final_model

    said: list[str] = []
    loop = SimpleNamespace(finished=True, state=None, served={2: object()}, device="client-2")
    assert save_final_model(loop, {}, said.append) is None
    assert len(said) == 1 and "--no-state" in said[0] and "nobody has it" in said[0]
    save_final_model(SimpleNamespace(finished=False, state=None, served={2: object()}, device="client-2"), {}, said.append)
    assert len(said) == 1  # a device that timed out says nothing of the run's end


def test_a_model_that_cannot_be_written_at_the_runs_end_is_one_line_and_the_device_ends_normally(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from safetensors import SafetensorError

    import edgefl.rundir as rundir
    from edgefl.fleet.launcher import save_final_model

    store = _save(tmp_path, run="run-a", round_no=3)
    loop = SimpleNamespace(finished=True, state=store, served={3: object()}, device="client-0", run_id="run-a",
                           client=SimpleNamespace(model=torch.nn.Linear(2, 2)))
    said: list[str] = []
    path = save_final_model(loop, {"model": "mlp", "dataset": "digits"}, said.append)
    assert path == tmp_path / MODEL and len(said) == 1 and f"edgefl export {path}" in said[0] and "--dataset" not in said[0]

    def refuse(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(rundir, "save_file", refuse)  # the model file's writer
    assert save_final_model(loop, {"model": "mlp"}, said.append) is None  # said, never raised: the run is over
    assert len(said) == 2 and "could not be saved" in said[1] and "StorageFull" in said[1]
    assert DeviceStateStore(tmp_path, "client-0", "fed", "a" * 64).load()[:2] == (3, "run-a")  # the round's state kept
    assert (tmp_path / MODEL).is_file()  # and the file written before: the write goes to a temporary name first


def test_a_state_folder_that_cannot_be_written_is_refused_before_the_device_joins(tmp_path):
    import subprocess
    import sys

    from edgefl.config import RunConfig
    from tests.conftest import digits_config

    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(EdgeflError, match="cannot write the device state folder") as caught:
        DeviceStateStore(tmp_path / "a-file" / "state", "client-0", "fed", "a" * 64).check_writable()
    assert "--no-state" in caught.value.hint and "writable --state-dir" in caught.value.hint
    from edgefl.device_state import check_state_dir  # a device with its own data checks before it has its task

    with pytest.raises(EdgeflError, match="cannot write the device state folder .*: it is under .*a-file, which is a file"):
        check_state_dir(tmp_path / "a-file" / "state")
    with pytest.raises(EdgeflError, match="it is a file, not a folder"):  # the file itself given as the folder
        check_state_dir(tmp_path / "a-file")
    DeviceStateStore(tmp_path / "new" / "state", "client-0", "fed", "a" * 64).check_writable()  # made, and left empty
    assert list((tmp_path / "new" / "state").iterdir()) == []
    # the command: refused at once with the hint (exit 2), no broker needed to find out
    cfg = tmp_path / "run.toml"
    cfg.write_text(RunConfig.model_validate(digits_config("fedhe", rounds=1)).to_toml())
    run = subprocess.run([sys.executable, "-m", "edgefl", "client", "--broker", "mqtt://127.0.0.1:9", "--config", str(cfg),
                          "--device-id", "client-0", "--timeout", "30", "--state-dir", str(tmp_path / "a-file" / "state")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    said = " ".join(run.stderr.split())
    assert "cannot write the device state folder" in said and "--no-state" in said
