"""The side-by-side scripts against the authors' code (bench/authors_*.py) say what to do when the
authors' checkout is missing or is not theirs, before any training (an outside trial waited out
the edgefl side's minutes for a ModuleNotFoundError traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, repo, extra", [
    ("authors_fedmho.py", "YXShi2000/FedMHO", []),
    ("authors_fedhe.py", "ChanYunHin/FedHe", []),
    ("authors_felo.py", "ChanYunHin/Felo_Velo", ["--sides", "authors"]),
])
def test_a_missing_or_foreign_checkout_is_refused_before_training(tmp_path, script, repo, extra):
    for folder, said in ((tmp_path / "absent", "does not exist"), (tmp_path, "is not a checkout of")):
        done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--authors-dir", str(folder), *extra],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 2, done.stderr[-2000:]
        assert said in done.stderr and f"git clone https://github.com/{repo}" in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr and not done.stdout.strip(), done.stdout[-2000:]


def test_fedhe_without_the_authors_run_needs_no_checkout(tmp_path):
    missing = subprocess.run([sys.executable, str(ROOT / "bench" / "authors_fedhe.py")], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
    assert missing.returncode == 2 and "--no-authors" in missing.stderr and "git clone" in missing.stderr


def test_fedmho_without_a_checkout_named_says_where_to_get_one(tmp_path):
    missing = subprocess.run([sys.executable, str(ROOT / "bench" / "authors_fedmho.py")], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
    assert missing.returncode == 2 and "git clone https://github.com/YXShi2000/FedMHO" in missing.stderr


def test_fedhe_without_keras_says_so_before_training(tmp_path):
    import importlib.util

    if importlib.util.find_spec("keras") is not None:
        pytest.skip("Keras is installed here")
    checkout = tmp_path / "FedHe"
    for name in ("main.py", "parameters.py", "modules/Client.py", "modules/Dataset.py", "modules/Server.py"):
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text("")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "authors_fedhe.py"), "--authors-dir", str(checkout)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "pip install keras" in done.stderr and "--no-authors" in done.stderr, done.stderr[-2000:]
