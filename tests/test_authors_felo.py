"""bench/authors_felo.py around the authors' code (issue 38, item 3): the parts that do not need
their checkout. Their code itself cannot run here without it (the repository does not hold it);
docs/methods.md records the runs that used it. Checked: a wrong folder is refused before any data
is loaded, with what to do; every edgefl config the script builds is one edgefl accepts; the
stand-ins for their missing modules leave ``sys.modules`` as they found it; the narrowed ``nn``
scales channel counts and keeps the image's input channels."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from edgefl.config import validate_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "authors_felo.py"


@pytest.fixture(scope="module")
def harness():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("bench_authors_felo", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "bench"))


def _args(**kw) -> argparse.Namespace:
    base = dict(seed=0, iterations=200, threads=1, partition="iid", alpha=0.5, test_samples=2000, width=0.25,
                feature_dim=128, curve=5, stem="imagenet", lr_milestones=[], velo_cvae_data="class_means")
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("argv, said", [
    (["--authors-dir", "{empty}"], "is not a checkout of github.com/ChanYunHin/Felo_Velo"),
    (["--sides", "authors"], "--authors-dir is needed"),
    (["--sides", "edgefl", "--iterations", "101"], "--iterations must be even"),
    (["--sides", "edgefl", "--methods", "felo,fedavg"], "--methods 'felo,fedavg': it takes felo, velo and local"),
    (["--sides", "edgefl", "--curve", "0"], "--curve must be at least 1"),
    (["--sides", "edgefl", "--test-samples", "700"], "--test-samples must be a multiple of 500"),
])
def test_a_wrong_command_is_refused_before_any_data_is_loaded(harness, tmp_path, monkeypatch, capsys, argv, said):
    monkeypatch.setattr(sys, "argv", ["authors_felo.py", *(a.replace("{empty}", str(tmp_path)) for a in argv)])
    monkeypatch.setattr(harness, "load", lambda name: pytest.fail("data loaded before the command was checked"))
    with pytest.raises(SystemExit) as stop:
        harness.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and said in err
    if "not a checkout" in said:
        assert "git clone https://github.com/ChanYunHin/Felo_Velo" in err


def test_a_checkout_with_every_file_the_script_runs_is_accepted(harness, tmp_path):
    # every module of theirs the script imports, and the ones those import, is a file it checks for
    source = SCRIPT.read_text()
    imported = set(re.findall(r'"(modules\.\w+)"', source)) | set(re.findall(r"import (modules\.\w+)", source))
    stand_ins = {"modules.utils", "modules.Model", "modules.old_Model", "modules.GAN_model"}  # .pyc only in their repository
    assert {"modules.Server_op", "modules.Server_new_VAE", "modules.Dataset", "modules.ResnetModel"} <= imported
    expected = {m.replace(".", "/") + ".py" for m in imported - stand_ins}
    expected |= {"modules/Client_op.py", "modules/Client_new_VAE.py", "modules/VAE_model.py", "parameters.py"}
    assert expected <= set(harness.AUTHORS_FILES)
    assert "modules/Server_new_VAE.py" in harness.checkout_problem(tmp_path)
    for name in harness.AUTHORS_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert harness.checkout_problem(tmp_path) is None


@pytest.mark.parametrize("method", ["felo", "velo", "local"])
@pytest.mark.parametrize("personal", [False, True])
def test_every_edgefl_config_the_script_builds_is_valid(harness, method, personal):
    cfg = validate_config(harness.edgefl_config(_args(), method, personal=personal), "authors_felo")
    assert cfg.method.name == method and cfg.rounds == 200 and cfg.train.optimizer_state == "kept"
    groups = cfg.fleet.groups
    assert sum(g.count for g in groups) == harness.NUM_CLIENTS
    if personal:  # one device a group: no weights averaged, as their code trains
        assert len(groups) == harness.NUM_CLIENTS and len({g.options["width"] for g in groups}) == harness.NUM_CLIENTS
    if method == "velo":  # their CVAE's schedule: 10 epochs every 1 % of the run, one feature a class
        assert (cfg.method.retrain_every, cfg.method.cvae_epochs, cfg.method.synthetic_per_class) == (2, 10, 1)
        assert cfg.method.latent_dim == cfg.method.hidden_dim == cfg.method.feature_dim == 128
        assert cfg.method.cvae_data == "class_means"  # Algorithm 2 unless asked


def test_their_per_sample_cvae_data_reaches_edgefl_s_velo_when_asked(harness):
    cfg = validate_config(harness.edgefl_config(_args(velo_cvae_data="sample_features"), "velo"), "authors_felo")
    assert (cfg.method.cvae_data, cfg.method.samples_per_upload, cfg.method.sample_store_size) == ("sample_features", 500, 4999)


def test_their_learning_rate_drop_and_a_nearer_stem_reach_edgefl_only_when_asked(harness):
    plain = validate_config(harness.edgefl_config(_args(), "local"), "authors_felo")
    assert plain.train.lr_milestones == [] and {g.options["stem"] for g in plain.fleet.groups} == {"imagenet"}
    theirs = validate_config(harness.edgefl_config(_args(stem="small", lr_milestones=[0.5]), "local"), "authors_felo")
    assert theirs.train.lr_at(100, 200) == 1e-3 and theirs.train.lr_at(101, 200) == pytest.approx(1e-4)
    assert {g.options["stem"] for g in theirs.fleet.groups} == {"small"}


def test_the_stand_ins_leave_sys_modules_as_they_found_it(harness):
    before = dict(sys.modules)
    replaced = harness.install_stand_ins("velo")
    assert {"pandas", "tqdm", "tkinter", "pdb", "modules.utils", "modules.GAN_model", "torch.utils.tensorboard"} <= set(replaced)
    assert sys.modules["modules.utils"].get_model_mask(None) == "velo"
    harness.restore_modules(replaced)
    assert {name: sys.modules.get(name) for name in replaced} == {name: before.get(name) for name in replaced}


def test_the_narrowed_nn_scales_every_channel_count_but_the_images(harness):
    nn = harness.narrowed_nn(0.25)
    stem, conv, bn = nn.Conv2d(1, 64, 3, padding=1), nn.Conv2d(in_channels=64, out_channels=256, kernel_size=1), nn.BatchNorm2d(256)
    assert (stem.in_channels, stem.out_channels) == (1, 16)
    assert (conv.in_channels, conv.out_channels, bn.num_features) == (16, 64, 64)
    assert nn.Linear is torch.nn.Linear  # their head reads latent_size, which the script narrows itself


@pytest.mark.parametrize("width", [0.1, 0.25, 0.3, 1.0])
def test_their_latent_size_is_the_width_their_narrowed_nets_emit(harness, width):
    # their last stage ends in 1024 channels; their Velo CVAE and feature loss are built for --latent_size
    assert harness.narrowed_nn(width).Conv2d(512, 1024, 1).out_channels == harness.their_feature_width(width)


def test_resume_keeps_an_earlier_sitting_of_the_same_setting_only(harness, tmp_path, capsys):
    same = {k: "0" for k in harness.SAME_RUN}
    saved = tmp_path / "authors_felo-x.json"
    assert harness.earlier_results(saved, same) == {}  # nothing saved yet: everything runs
    saved.write_text(json.dumps({"same_run": same, "results": {"authors Velo": {"own": 0.8}}, "complete": False}))
    assert harness.earlier_results(saved, same) == {"authors Velo": {"own": 0.8}}
    with pytest.raises(SystemExit, match="holds another setting \\(seed differ\\)"):
        harness.earlier_results(saved, {**same, "seed": "1"})
    saved.write_text('{"results": ')  # a sitting stopped while writing
    with pytest.raises(SystemExit, match="is not a result this script wrote"):
        harness.earlier_results(saved, same)
