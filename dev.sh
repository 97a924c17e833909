#!/usr/bin/env bash
# Sets up everything edgefl needs on a fresh machine, then runs one job:
#   ./dev.sh demo [edgefl simulate options]   the main job on its embedded defaults
#   ./dev.sh test [pytest options]            lint (ruff) and the test suite (what .ci/run calls)
#   ./dev.sh bench NAME [options]             a benchmark from bench/
#   ./dev.sh edgefl ARGS...                   any edgefl command inside the environment
# Set-up is idempotent: the virtual environment (.venv, or $EDGEFL_VENV) is rebuilt only when
# pyproject.toml changes. As root it also installs the Debian packages the job needs.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
VENV=${EDGEFL_VENV:-$ROOT/.venv}
job=${1:-demo}
shift || true

apt_install() {
    # Debian packages: the Fashion-MNIST IDX files, and mosquitto for the MQTT tests.
    local missing=()
    for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "note: not root, so not installing ${missing[*]} (apt-get install ${missing[*]})" >&2
        return 0
    fi
    echo "installing Debian packages: ${missing[*]}" >&2
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
}

pick_python() {
    # torch wheels for this project are built for CPython 3.11 (3.10-3.12 work too).
    for py in python3.11 python3.12 python3.10 python3; do
        if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(not (3,10) <= sys.version_info[:2] <= (3,12))'; then
            echo "$py"; return 0
        fi
    done
    echo "error: edgefl needs Python 3.10-3.12 (none found on PATH)" >&2; exit 1
}

setup_venv() {
    local stamp="$VENV/.edgefl-stamp" want
    want=$(cat pyproject.toml dev.sh | sha256sum | cut -c1-16)
    if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then return 0; fi
    echo "setting up $VENV (first run: about two minutes)" >&2
    [ -x "$VENV/bin/python" ] || "$(pick_python)" -m venv "$VENV"
    local pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
    # Pin torch first: an unpinned resolve could pull a newer multi-GB build.
    "${pip[@]}" "torch==${EDGEFL_TORCH:-2.14.1}" "torchvision==${EDGEFL_TORCHVISION:-0.29.1}" 2>&1 | grep -v "is ignored" >&2 || true
    "$VENV/bin/python" -c "import torch, torchvision" || { echo "error: torch did not install" >&2; exit 1; }
    # ... and keep it pinned while the extras resolve (an export dependency could pull another torch)
    "${pip[@]}" -e ".[test]" "torch==${EDGEFL_TORCH:-2.14.1}" "torchvision==${EDGEFL_TORCHVISION:-0.29.1}" 2>&1 | grep -v "is ignored" >&2 || true
    "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${EDGEFL_TORCH:-2.14.1}')" \
        || { echo "error: the extras replaced the pinned torch" >&2; exit 1; }
    "$VENV/bin/python" -c "import edgefl.server, edgefl.exporters" || { echo "error: edgefl did not install" >&2; exit 1; }
    echo "$want" > "$stamp"
}

case "$job" in
    demo)
        apt_install dataset-fashion-mnist
        setup_venv
        exec "$VENV/bin/edgefl" simulate "$@"
        ;;
    test)
        # chromium: the dashboard's browser tests (driven by Playwright)
        apt_install dataset-fashion-mnist mosquitto chromium
        setup_venv
        # lint first (pyproject.toml [tool.ruff]): a finding fails the run before the slow tests
        "$VENV/bin/ruff" check . || { echo "ruff found problems (see above); fix them or run: $VENV/bin/ruff check --fix ." >&2; exit 1; }
        exec "$VENV/bin/python" -m pytest "$@"
        ;;
    bench)
        apt_install dataset-fashion-mnist mosquitto
        setup_venv
        name=${1:?usage: ./dev.sh bench NAME [options]}; shift
        exec "$VENV/bin/python" "bench/$name.py" "$@"
        ;;
    edgefl)
        setup_venv
        exec "$VENV/bin/edgefl" "$@"
        ;;
    setup)
        apt_install dataset-fashion-mnist mosquitto
        setup_venv
        ;;
    *)
        echo "usage: ./dev.sh demo|test|bench NAME|edgefl ARGS|setup" >&2; exit 2
        ;;
esac
