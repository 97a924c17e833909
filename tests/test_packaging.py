"""The built wheel installs edgefl.server and edgefl.exporters inside edgefl, nothing at top level."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_wheel_installs_server_and_exporters_inside_edgefl(tmp_path):
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    if not files:  # not a git checkout (e.g. an sdist): copy the tree
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", "runs", "build", "*.egg-info"))
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(src)],
                   check=True, capture_output=True, timeout=300)
    wheel = next(dist.glob("edgefl-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"edgefl", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    assert "edgefl/server/methods/fedhe.py" in names and "edgefl/exporters/__init__.py" in names
    assert "edgefl/defaults/fedhe-fashion-mnist.toml" in names and "edgefl/firmware_profiles/__init__.py" in names
    # the dashboard's page and its vendored chart library: no network at run time
    assert {"edgefl/dashboard/static/index.html", "edgefl/dashboard/static/app.js",
            "edgefl/dashboard/static/vendor/chart.umd.min.js"} <= set(names)
    # every package of the source tree made it into the wheel (a missing one only fails once installed)
    for init in sorted(ROOT.glob("edgefl/**/__init__.py")):
        assert str(init.relative_to(ROOT)) in names, f"{init.parent.name} is missing from pyproject's packages"
    for top, inside in (("server", "edgefl/server"), ("exporters", "edgefl/exporters")):
        for init in sorted((ROOT / top).glob("**/__init__.py")):
            assert f"{inside}/{init.relative_to(ROOT / top)}" in names, init

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=120)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert not (Path(site) / "server").exists() and not (Path(site) / "exporters").exists()
    # imported from outside the repository, so the source tree cannot be what is found
    probe = ("import edgefl.server, edgefl.exporters, edgefl.firmware_profiles, importlib.resources as r;"
             "print(edgefl.server.__file__);"
             "print(r.files('edgefl.defaults').joinpath('fedhe-fashion-mnist.toml').is_file())")
    res = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path, check=True)
    server_file, has_default = res.stdout.split()
    assert server_file.startswith(site) and has_default == "True"
    res = subprocess.run([str(py), "-c", "import server"], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode != 0
