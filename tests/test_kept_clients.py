"""A one-shot run's clients kept (simulation.keep_clients) and fused again by another server half
(simulation.clients_from): the same numbers as training them, no training, and every way a kept
folder can be wrong refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch

from edgefl.algorithms.fedmho import FedMHOClient
from edgefl.config import RunConfig
from edgefl.errors import ConfigError
from edgefl.rundir import RunDir
from edgefl.sim import Simulation
from edgefl.sim.kept_clients import CLIENTS_DIR, MANIFEST
from tests.test_fedmho import fedmho_config


def _run(raw: dict, tmp_path, name: str, sims: list | None = None) -> tuple[dict, RunDir]:
    raw["threads"] = 1  # a kernel's sums depend on its threads: the runs compared train alike
    run = RunDir.create(tmp_path / name, name, 0)
    sim = Simulation(RunConfig.model_validate(raw), run, show_progress=False)
    if sims is not None:
        sims.append(sim)
    return sim.run(), run


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """A FedMHO run that kept its clients."""
    tmp = tmp_path_factory.mktemp("kept")
    raw = fedmho_config("fedmho")
    raw["simulation"] = {"keep_clients": True}
    summary, run = _run(raw, tmp, "source")
    return summary, run.path


def test_fused_again_from_kept_clients_gives_the_numbers_training_gives_and_trains_nothing(kept, tmp_path, monkeypatch):
    _, source = kept
    sims: list = []
    trained, _ = _run(fedmho_config("fedmho-md"), tmp_path, "trained", sims)
    raw = fedmho_config("fedmho-md")
    raw["simulation"] = {"clients_from": str(source)}
    calls = []
    real = FedMHOClient.fit
    monkeypatch.setattr(FedMHOClient, "fit", lambda self, *a, **k: calls.append(self.client_id) or real(self, *a, **k))
    replayed, run = _run(raw, tmp_path, "replayed", sims)
    assert calls == []  # no client trained
    for cid, client in sims[1].clients.items():  # each device holds the weights it trained (CVAE encoders too)
        want = sims[0].clients[cid].model.state_dict()
        assert [k for k, t in client.model.state_dict().items() if not torch.equal(t, want[k])] == [], cid
    assert replayed["final_accuracy"] == trained["final_accuracy"]  # the global model, per client (judged VGGs) and FedAvg
    facts = json.loads((run.path / "run.json").read_text())["simulation"]["clients_from"]
    assert facts["method"] == "fedmho" and facts["path"] == str((source / CLIENTS_DIR).resolve())
    assert facts["edgefl_commit"] == json.loads((source / "run.json").read_text())["edgefl_commit"]


def test_the_kept_folder_holds_a_message_and_a_state_per_device_and_a_manifest(kept):
    _, source = kept
    manifest = json.loads((source / CLIENTS_DIR / MANIFEST).read_text())
    assert manifest["method"] == "fedmho" and len(manifest["devices"]) == 4
    assert manifest["client_config"]["method_options"] == {}  # FedMHO's options are all the server's
    for entry in manifest["devices"].values():
        assert (source / CLIENTS_DIR / f"{entry['file']}.msg").stat().st_size == entry["message_bytes"]


def test_clients_trained_on_another_config_are_refused_naming_what_differs(kept):
    _, source = kept
    raw = fedmho_config("fedmho-sd")
    raw["train"]["lr"] = 0.01
    raw["seed"] = 3
    raw["simulation"] = {"clients_from": str(source)}
    with pytest.raises(ConfigError, match=r"another config \(seed, train.lr differ\)") as err:
        Simulation(RunConfig.model_validate(raw), show_progress=False)
    assert "keep_clients" in err.value.hint


def test_a_fleet_difference_names_the_group_and_key(kept):
    _, source = kept
    raw = fedmho_config("fedmho-md")
    raw["fleet"]["groups"][1]["train"] = {"epochs": 3}
    raw["simulation"] = {"clients_from": str(source)}
    with pytest.raises(ConfigError, match=r"fleet.groups.1.train.epochs differs"):
        Simulation(RunConfig.model_validate(raw), show_progress=False)


def test_server_options_may_differ_but_not_the_client_half(kept, tmp_path):
    _, source = kept
    raw = fedmho_config("fedmho-sd", lam=0.9, synthetic_samples=200, global_epochs=1)
    raw["simulation"] = {"clients_from": str(source)}
    Simulation(RunConfig.model_validate(raw), show_progress=False)  # accepted: the server's options alone differ


@pytest.mark.parametrize("damage, said", [
    ("no-manifest", "kept no clients"),
    ("message-changed", "SHA-256 differs"),
    ("message-truncated", "the manifest says"),
    ("manifest-garbage", "cannot be read"),
    ("manifest-hostile", "malformed entry"),
    ("state-missing", "not a plain file"),
    ("state-linked", "not a plain file"),
    ("state-of-a-cvae", "state is of another model"),
    ("state-of-another-device", "counts .* training samples"),
    ("state-nonfinite", "non-finite|NaN|inf"),
    ("round-2", "answers round 1"),
    ("device-renamed", "none kept for: 'client-3'"),
    ("upload-of-a-cvae", "not its trained model's"),
    ("upload-counts-nothing", "counts None training samples"),
    ("state-without-its-upload", "not its trained model's"),
    ("manifest-linked", "a link"),
])
def test_a_damaged_or_hostile_kept_folder_is_refused_with_the_reason(kept, tmp_path, damage, said):
    import shutil

    _, source = kept
    copy = tmp_path / "copy"
    shutil.copytree(source / CLIENTS_DIR, copy / CLIENTS_DIR)
    folder = copy / CLIENTS_DIR
    manifest = json.loads((folder / MANIFEST).read_text())
    first = manifest["devices"][sorted(manifest["devices"])[0]]["file"]

    def rehash(device: str, kind: str, data: bytes) -> None:  # an edit the manifest agrees with: only the content can tell
        import hashlib

        entry = manifest["devices"][device]
        (folder / (f"{entry['file']}.msg" if kind == "message" else f"{entry['file']}.state.safetensors")).write_bytes(data)
        entry[f"{kind}_bytes"], entry[f"{kind}_sha256"] = len(data), hashlib.sha256(data).hexdigest()
        (folder / MANIFEST).write_text(json.dumps(manifest))

    def state_of(device: str) -> bytes:
        return (folder / f"{manifest['devices'][device]['file']}.state.safetensors").read_bytes()

    def message_of(device: str) -> bytes:
        return (folder / f"{manifest['devices'][device]['file']}.msg").read_bytes()
    if damage == "no-manifest":
        (folder / MANIFEST).unlink()
    elif damage == "message-changed":
        data = bytearray((folder / f"{first}.msg").read_bytes())
        data[-1] ^= 0xFF
        (folder / f"{first}.msg").write_bytes(bytes(data))
    elif damage == "message-truncated":
        (folder / f"{first}.msg").write_bytes((folder / f"{first}.msg").read_bytes()[:-8])
    elif damage == "manifest-garbage":
        (folder / MANIFEST).write_bytes(b"\xff\xfe{not json")
    elif damage == "manifest-hostile":
        manifest["devices"][sorted(manifest["devices"])[0]]["file"] = "../../etc/passwd"
        (folder / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "state-missing":
        (folder / f"{first}.state.safetensors").unlink()
    elif damage == "state-linked":  # a link to a copy elsewhere, hashes and all
        outside = tmp_path / "elsewhere.safetensors"
        outside.write_bytes((folder / f"{first}.state.safetensors").read_bytes())
        (folder / f"{first}.state.safetensors").unlink()
        (folder / f"{first}.state.safetensors").symlink_to(outside)
    elif damage == "state-of-a-cvae":  # client-2 trains a CVAE, client-0 an MLP
        rehash("client-0", "state", state_of("client-2"))
    elif damage == "state-of-another-device":  # client-1: the same MLP, other data
        rehash("client-0", "state", state_of("client-1"))
        from edgefl.messages import decode, encode

        message = decode(message_of("client-1"))
        message.sender = "client-0"
        rehash("client-0", "message", encode(message))
    elif damage == "state-nonfinite":
        from safetensors.torch import load, save

        state = load(state_of("client-0"))
        next(t for t in state.values() if t.is_floating_point()).view(-1)[0] = float("nan")
        rehash("client-0", "state", save(state))
    elif damage == "round-2":
        from edgefl.messages import decode, encode

        message = decode(message_of("client-0"))
        message.round = 2
        manifest["devices"]["client-0"]["round"] = 2
        rehash("client-0", "message", encode(message))
    elif damage in ("upload-of-a-cvae", "upload-counts-nothing"):
        from edgefl.messages import decode, encode

        own = decode(message_of("client-0"))
        message = decode(message_of("client-2")) if damage == "upload-of-a-cvae" else own
        message.sender = "client-0"
        if damage == "upload-of-a-cvae":  # a decoder under the MLP client's name and sample count
            message.meta["num_samples"] = own.meta["num_samples"]
        else:
            del message.meta["num_samples"]
        rehash("client-0", "message", encode(message))
    elif damage == "state-without-its-upload":  # client-1's state (same MLP) beside client-0's own upload
        rehash("client-0", "state", state_of("client-1"))
    elif damage == "manifest-linked":
        outside = tmp_path / "elsewhere.json"
        outside.write_text((folder / MANIFEST).read_text())
        (folder / MANIFEST).unlink()
        (folder / MANIFEST).symlink_to(outside)
    elif damage == "device-renamed":
        manifest["devices"]["client-X"] = manifest["devices"].pop("client-3")
        (folder / MANIFEST).write_text(json.dumps(manifest))
    raw = fedmho_config("fedmho-md")
    raw["simulation"] = {"clients_from": str(copy)}
    with pytest.raises(ConfigError, match=said):
        Simulation(RunConfig.model_validate(raw), show_progress=False)


def test_a_missing_folder_is_refused_and_only_one_shot_methods_keep_clients(tmp_path):
    raw = fedmho_config("fedmho-md")
    raw["simulation"] = {"clients_from": str(tmp_path / "nowhere")}
    with pytest.raises(ConfigError, match="no such folder"):
        Simulation(RunConfig.model_validate(raw), show_progress=False)
    from tests.conftest import digits_config

    for key, value in (("keep_clients", True), ("clients_from", str(tmp_path))):
        other = digits_config("fedavg", rounds=2)
        other["simulation"] = {key: value}
        with pytest.raises(ValueError, match="one-shot methods"):
            RunConfig.model_validate(other)
        one_shot = fedmho_config("fedmho")
        one_shot["simulation"] = {key: value, "workers": 2}
        with pytest.raises(ValueError, match="every device in this process"):
            RunConfig.model_validate(one_shot)
    both = fedmho_config("fedmho")
    both["simulation"] = {"keep_clients": True, "clients_from": str(tmp_path)}
    with pytest.raises(ValueError, match="copy of clients kept already"):
        RunConfig.model_validate(both)
    empty = fedmho_config("fedmho")
    empty["simulation"] = {"clients_from": " "}
    with pytest.raises(ValueError, match="names the run directory"):
        RunConfig.model_validate(empty)
    (tmp_path / "a-file").write_text("x")
    relative = fedmho_config("fedmho-md")
    relative["simulation"] = {"clients_from": "some/where"}
    assert RunConfig.model_validate(relative).simulation.clients_from.startswith("/")  # config.toml means one folder wherever it is resumed
    relative["simulation"] = {"clients_from": str(tmp_path / "a-file")}
    with pytest.raises(ConfigError, match="a file, not a run directory"):
        Simulation(RunConfig.model_validate(relative), show_progress=False)


def test_the_local_baseline_beside_a_run_that_keeps_or_takes_clients_trains_its_own(kept, tmp_path):
    from edgefl.baseline import baseline_config

    _, source = kept
    for sim in ({"keep_clients": True, "baseline": "local"}, {"clients_from": str(source), "baseline": "local"}):
        raw = fedmho_config("fedmho-md")
        raw["simulation"] = sim
        base = baseline_config(RunConfig.model_validate(raw))
        assert not base.simulation.keep_clients and base.simulation.clients_from is None


def test_a_fleet_refuses_both_keys(tmp_path):
    from edgefl.sim.kept_clients import refuse_outside_simulation

    raw = fedmho_config("fedmho-md")
    raw["simulation"] = {"clients_from": str(tmp_path)}
    with pytest.raises(ConfigError, match="is for edgefl simulate: in edgefl fleet"):
        refuse_outside_simulation(RunConfig.model_validate(raw), "edgefl fleet")


def test_the_console_says_the_clients_were_kept_and_that_none_trained(kept, tmp_path):
    import io

    from rich.console import Console

    _, source = kept
    raw = fedmho_config("fedmho-sd")
    raw["simulation"] = {"clients_from": str(source)}
    raw["threads"] = 1
    out = io.StringIO()
    Simulation(RunConfig.model_validate(raw), None, console=Console(file=out, width=300), show_progress=False).run()
    assert f"clients: no device trains; each answers with the upload and trained model kept in {source / CLIENTS_DIR}" in out.getvalue()
