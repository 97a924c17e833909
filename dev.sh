#!/usr/bin/env bash
# Sets up everything edgefl needs on a fresh machine, then runs one job:
#   ./dev.sh demo [edgefl simulate options]   the main job on its embedded defaults
#   ./dev.sh test [pytest options]            lint (ruff) and the test suite (what .ci/run calls)
#   ./dev.sh bench NAME [options]             a benchmark from bench/, run in the checkout (a relative path
#                                             you give it, --out, --merge, --authors-dir, is from your folder)
#   ./dev.sh edgefl ARGS...                   any edgefl command inside the environment, run in the
#                                             folder you are in (its relative paths are yours)
#   ./dev.sh arm-device [bench options]       an emulated 64-bit ARM device (Debian arm64 root file system
#                                             under qemu-user-static, edgefl installed as on a Pi), then
#                                             bench/arm_device.py: profile, fleet run under a RAM cap, footprints
# Set-up is idempotent: the virtual environment (.venv, or $EDGEFL_VENV) is rebuilt only when
# pyproject.toml changes. As root it also installs the Debian packages the job needs. A venv
# holds one checkout's edgefl (editable): one set up from another checkout is refused, not re-pointed.
set -euo pipefail
# paths a user gives (a config, --out, --merge) are theirs: relative to where they ran this from
CALLER_DIR=$PWD
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
    install_venv
    # An editable install leaves edgefl's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE
    # is set (CI images often set it) every process compiles them again on import: about 3 s of CPU
    # for each `edgefl client` a fleet starts. Compiled once here (only changed files are redone),
    # Python reads the cached bytecode whatever that variable says.
    "$VENV/bin/python" -m compileall -q -j 0 edgefl exporters server examples bench tests >/dev/null || true
}

install_venv() {
    local stamp="$VENV/.edgefl-stamp" want had_hash="" had_root=""
    want=$(cat pyproject.toml dev.sh | sha256sum | cut -c1-16)
    [ -f "$stamp" ] && read -r had_hash had_root < "$stamp" || true
    # edgefl goes in editable: setting up a venv another checkout uses ($EDGEFL_VENV shared with a
    # worktree) would point it, and that checkout's `edgefl` commands, at this one; say so instead
    if [ -x "$VENV/bin/python" ] && [ -n "$had_root" ] && [ "$had_root" != "$ROOT" ] && [ -d "$had_root" ] \
        && [ "${EDGEFL_VENV_MOVE:-0}" != 1 ]; then
        echo "error: $VENV holds the edgefl of $had_root (an editable install); using it from $ROOT would" >&2
        echo "  point it here. Give this checkout a venv of its own (unset EDGEFL_VENV, or another path)," >&2
        echo "  or set EDGEFL_VENV_MOVE=1 to move it here. (That venv's python and edgefl run $had_root's" >&2
        echo "  code; only bench/paper.py, run from here with it, imports this checkout's.)" >&2
        exit 2
    fi
    if [ -x "$VENV/bin/python" ] && [ "$had_hash" = "$want" ] && [ "$had_root" = "$ROOT" ]; then return 0; fi
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
    echo "$want $ROOT" > "$stamp"
}

bench_list() {  # the benchmarks, one a line (common.py is their library, not one)
    (cd bench && ls *.py | sed 's/\.py$//' | grep -vx common)
}

bench_names() {
    echo "usage: ./dev.sh bench NAME [options]; NAME one of:" $(bench_list)
    echo "(./dev.sh bench NAME --help: its options; docs/benchmarks.md: what each measures)"
}

bench_closest() {
    # the benchmark a mistyped NAME most likely meant (difflib: the standard library's, no venv needed)
    bench_list | python3 -c '
import difflib, sys
near = difflib.get_close_matches(sys.argv[1], [line.strip() for line in sys.stdin], n=1)
print(near[0] if near else "")' "$1" 2>/dev/null || true
}

arm_device_root() {
    # A Debian bookworm arm64 root file system (what Raspberry Pi OS 64-bit is built on), made once
    # and cached; edgefl goes in as a user installs it on a Pi: a venv, the aarch64 torch wheels
    # from PyPI, then edgefl's core package (a wheel built from this checkout). Needs root (chroot).
    ARM_ROOT=${EDGEFL_ARM_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/edgefl/arm64-bookworm}
    [ "$(id -u)" -eq 0 ] || { echo "error: the ARM device needs root (debootstrap, chroot, a memory cgroup)" >&2; exit 1; }
    if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    fi
    update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || { echo "error: no qemu-aarch64 binfmt handler (qemu-user-static)" >&2; exit 1; }
    if [ ! -x "$ARM_ROOT/usr/bin/python3" ]; then
        echo "building the arm64 root file system in $ARM_ROOT (once; about 10 minutes under emulation)" >&2
        mkdir -p "$(dirname "$ARM_ROOT")"
        rm -rf "$ARM_ROOT.partial"
        debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
            bookworm "$ARM_ROOT.partial" "${EDGEFL_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >&2
        mv "$ARM_ROOT.partial" "$ARM_ROOT"
    fi
    # this machine's CA bundle (a proxy may sign PyPI's certificate) and its resolver, for pip
    cp /etc/ssl/certs/ca-certificates.crt "$ARM_ROOT/etc/ssl/certs/host-ca-bundle.crt"
    cp /etc/resolv.conf "$ARM_ROOT/etc/resolv.conf" 2>/dev/null || true
    rm -rf "$ROOT/build/arm-wheel" && "$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$ROOT/build/arm-wheel" . >&2
    local wheel stamp want
    wheel=$(ls "$ROOT"/build/arm-wheel/edgefl-*.whl)
    # the wheel's RECORD (every file's hash), not the wheel itself, whose zip timestamps change on each build
    want=$("$VENV/bin/python" -c 'import hashlib, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
print(hashlib.sha256(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/RECORD")))).hexdigest()[:16])' "$wheel")
    stamp="$ARM_ROOT/opt/edgefl/.edgefl-stamp"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        echo "installing edgefl in the ARM device (venv /opt/edgefl, torch ${EDGEFL_ARM_TORCH:-2.9.1} for aarch64)" >&2
        # the host's PIP_* settings name host paths; requests takes the CA bundle from REQUESTS_CA_BUNDLE
        local devpip=(/usr/bin/env -u PIP_CERT -u PIP_FIND_LINKS PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180
                      REQUESTS_CA_BUNDLE=/etc/ssl/certs/host-ca-bundle.crt /opt/edgefl/bin/pip)
        [ -x "$ARM_ROOT/opt/edgefl/bin/python" ] || chroot "$ARM_ROOT" python3 -m venv /opt/edgefl
        chroot "$ARM_ROOT" "${devpip[@]}" install -q \
            "torch==${EDGEFL_ARM_TORCH:-2.9.1}" "torchvision==${EDGEFL_ARM_TORCHVISION:-0.24.1}" >&2
        cp "$wheel" "$ARM_ROOT/tmp/"
        chroot "$ARM_ROOT" "${devpip[@]}" install -q --force-reinstall --no-deps "/tmp/$(basename "$wheel")" >&2
        chroot "$ARM_ROOT" "${devpip[@]}" install -q "/tmp/$(basename "$wheel")" >&2
        echo "$want" > "$stamp"
    fi
    # the device's own data: the Fashion-MNIST files where Debian puts them
    mkdir -p "$ARM_ROOT/usr/share/datasets"
    [ -d "$ARM_ROOT/usr/share/datasets/fashion-mnist" ] || cp -r /usr/share/datasets/fashion-mnist "$ARM_ROOT/usr/share/datasets/"
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
        # the tests in parallel processes (pytest-xdist), one a core up to four: each test trains
        # on one thread, and many wait on brokers and device processes; EDGEFL_TEST_WORKERS=0 runs
        # them in this one process (options given after `test` come later and win over these);
        # the 25 slowest tests are listed at the end: CI is kept under about 30 minutes
        cores=$(nproc 2>/dev/null || echo 1)
        workers=${EDGEFL_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
        exec "$VENV/bin/python" -m pytest -n "$workers" --durations=25 "$@"
        ;;
    bench)
        name=${1:-}; shift || true
        # (python would say "can't open file"; common.py is the benchmarks' library, not one)
        if [[ $name == -h || $name == --help ]]; then bench_names; exit 0; fi  # asked for: stdout, pipe it on
        if [[ -z $name ]]; then echo "./dev.sh bench needs a benchmark's NAME" >&2; bench_names >&2; exit 2; fi
        if [[ ! -f "bench/$name.py" || $name == -* || $name == common ]]; then
            echo "no benchmark '$name' in bench/" >&2
            near=$(bench_closest "$name")
            [[ -n $near ]] && echo "did you mean: ./dev.sh bench $near" >&2
            bench_names >&2; exit 2
        fi
        apt_install dataset-fashion-mnist mosquitto
        setup_venv
        export EDGEFL_CALLER_DIR=$CALLER_DIR  # (a benchmark takes a relative path you give from there: bench/common.py users_path)
        exec "$VENV/bin/python" "bench/$name.py" "$@"
        ;;
    edgefl)
        setup_venv
        cd "$CALLER_DIR"  # a command line like any other: its paths (and runs/) where the user is
        exec "$VENV/bin/edgefl" "$@"
        ;;
    setup)
        apt_install dataset-fashion-mnist mosquitto
        setup_venv
        ;;
    arm-device)
        apt_install dataset-fashion-mnist mosquitto qemu-user-static debootstrap binfmt-support
        setup_venv
        arm_device_root
        exec "$VENV/bin/python" bench/arm_device.py --root "$ARM_ROOT" "$@"
        ;;
    *)
        echo "usage: ./dev.sh demo|test|bench NAME|edgefl ARGS|setup|arm-device" >&2; exit 2
        ;;
esac
