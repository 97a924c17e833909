"""bench/arm_device.py's answers to a wrong --root: fast, no ARM device needed (test_arm_device.py
runs the device itself)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("what", ["missing", "empty folder", "a file"])
def test_a_root_that_is_not_a_built_device_is_refused_before_anything_is_mounted(tmp_path, what):
    # a mistyped --root used to mount /proc, /sys and /dev under whatever folder it named
    root = tmp_path / "root"
    if what == "empty folder":
        root.mkdir()
    elif what == "a file":
        root.write_text("")
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "arm_device.py"), "--root", str(root)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert f"--root {root}" in res.stderr and "./dev.sh arm-device builds it" in res.stderr
    assert not (root / "proc").exists() or not os.path.ismount(root / "proc")
