"""The emulated 64-bit ARM device (issue: a device as it really is). Slow: under qemu-user a device
process takes minutes, so this runs only with ``-m slow`` and where ``./dev.sh arm-device`` has
built the arm64 root file system; bench/arm_device.py (which this calls) covers it otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARM_ROOT = Path(os.environ.get("EDGEFL_ARM_ROOT", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edgefl" / "arm64-bookworm"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (ARM_ROOT / "opt" / "edgefl" / "bin" / "edgefl").exists(),
                       reason="no ARM device built (./dev.sh arm-device builds it)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the ARM device needs root (chroot, a memory cgroup)"),
]


def test_arm_device_joins_a_fleet_under_a_pi_zero_cap_with_x86_numbers(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "arm_device.py"), "--root", str(ARM_ROOT), "--rounds", "1",
                          "--skip", "footprints"], capture_output=True, text=True, timeout=3600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads((ROOT / "bench" / "results" / "arm_device.json").read_text())
    assert result["device_profile"]["arch"] == "aarch64"
    fleet = result["fleet"]
    assert fleet["arm"]["exit_codes"] == [0, 0] and fleet["arm"]["oom_kills"] == [0]
    assert fleet["arm"]["guest_peak_bytes"][1] <= result["ram_bytes"]
    assert fleet["comparison"]["equal_within_tolerance"]
