"""./dev.sh's own answers that come before any set-up (they must work on a fresh machine)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _dev_sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "dev.sh"), *args], capture_output=True, text=True, timeout=60)


def test_bench_help_lists_the_benchmarks_on_stdout():
    # asked for, the list is the answer (stdout, exit 0: `./dev.sh bench --help | less` shows it)
    done = _dev_sh("bench", "--help")
    assert done.returncode == 0, done.stderr
    assert "paper" in done.stdout.split() and "common" not in done.stdout.split()
    assert done.stderr == ""


@pytest.mark.parametrize("name, said", [("papr", "no benchmark 'papr' in bench/"), ("common", "no benchmark 'common'"),
                                        ("", "needs a benchmark's NAME")])
def test_a_benchmark_name_mistyped_or_missing_is_an_error_on_stderr_that_lists_the_names(name, said):
    # (common.py is the benchmarks' library, not one; no name was bash's "line 153: 1: usage", exit 1)
    done = _dev_sh("bench", *([name] if name else []))
    assert done.returncode == 2
    assert said in done.stderr and "paper" in done.stderr.split()
    assert done.stdout == ""
    assert ("did you mean: ./dev.sh bench paper" in done.stderr) == (name == "papr")


def test_a_venv_another_checkout_installed_is_not_pointed_here(tmp_path):
    # EDGEFL_VENV shared with a worktree: setting it up from here would re-point the other
    # checkout's editable edgefl at this one (its `edgefl` commands then ran this code)
    other, venv = tmp_path / "other-checkout", tmp_path / "venv"
    other.mkdir()
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / ".edgefl-stamp").write_text(f"0123456789abcdef {other}\n")
    done = subprocess.run(["bash", str(ROOT / "dev.sh"), "edgefl", "--version"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "EDGEFL_VENV": str(venv)})
    assert done.returncode == 2, done.stderr
    assert f"holds the edgefl of {other}" in done.stderr and "EDGEFL_VENV_MOVE=1" in done.stderr
    assert (venv / ".edgefl-stamp").read_text() == f"0123456789abcdef {other}\n"  # nothing installed over it
