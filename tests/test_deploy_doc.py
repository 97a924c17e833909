"""docs/deploy.md's device recipe, kept runnable: the systemd unit's ExecStart is a command line
`edgefl client` accepts, and the recipe never installs PyPI's unrelated `edgefl`."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"


def test_the_systemd_units_command_line_is_one_edgefl_client_accepts(tmp_path):
    from edgefl.fleet.broker import free_port

    unit = DEPLOY.read_text().split("```ini")[1].split("```")[0]
    exec_start = re.search(r"^ExecStart=(.+)$", unit, re.M).group(1)
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/edgefl") and argv[1] == "client"
    options = dict(zip(argv[2::2], argv[3::2]))
    assert options["--broker-wait"] == "inf" and "--data" in options and "--federation" in options and "--config" not in options
    # the same options, against a closed local port and without the wait: they parse, and the
    # client gets as far as the broker
    options.update({"--broker": f"mqtt://127.0.0.1:{free_port()}", "--broker-wait": "0", "--data": str(tmp_path),
                    "--state-dir": str(tmp_path / "state")})
    del options["--ca-file"]  # plain mqtt:// here: no TLS broker runs in this test
    from edgefl.transport.signing import write_keypair

    _, public = write_keypair(tmp_path)  # what broker-config writes, where the unit expects it
    assert options["--server-key"].endswith("server-signing.pub")
    options["--server-key"] = str(public)
    args = [x for kv in options.items() for x in kv]
    res = subprocess.run([sys.executable, "-m", "edgefl", "client", *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "cannot reach the broker" in res.stderr, res.stderr[-2000:]
    assert "RestartPreventExitStatus=2" in unit


def test_the_recipes_never_install_pypis_edgefl():
    docs = Path(__file__).resolve().parents[1] / "docs"
    for page in ("deploy.md", "devices.md", "your-data.md"):
        text = (docs / page).read_text() if (docs / page).is_file() else ""
        for line in text.splitlines():
            if "never" in line:
                continue
            # `pip install edgefl` / "edgefl[extra]" as a requirement name (a path such as /opt/edgefl/bin is fine)
            pypi = re.search(r"pip install[^#\n]*?(?<![\w./-])[\"']?edgefl(\[[^\]]*\])?[\"']?(?=\s|$)", line)
            assert pypi is None, f"{page}: {line.strip()} would install PyPI's unrelated edgefl"
