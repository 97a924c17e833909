#!/bin/bash
# Here, before a lent GPU's call: what that machine lacks, put where the call carries it (issue 38).
# The device machine reaches no package index and no data: it gets, with the working tree,
#   .whl/        the wheels edgefl needs beyond the machine's own packages (CPython 3.12, manylinux x86_64),
#                at the versions of this checkout's .venv
#   .gpu/data/   the Fashion-MNIST IDX files (EDGEFL_DATA points there)
# Both are git-ignored; name them in the call's carry: [".whl", ".gpu"]. Then run bench/gpu/session.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
WANT="pydantic pydantic-core annotated-types typing-inspection typing-extensions tomli-w paho-mqtt cryptography cffi pycparser"
pins=()
for name in $WANT; do
  v=$($PY -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$v" ] || { echo "error: $name is not in $PY's environment (./dev.sh edgefl --help builds it)" >&2; exit 1; }
  pins+=("$name==$v")
done
rm -rf .whl && mkdir -p .whl
plat=(); for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl "${pins[@]}"
src=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
[ -f "$src/train-images-idx3-ubyte.gz" ] || [ -f "$src/train-images-idx3-ubyte" ] \
  || { echo "error: no Fashion-MNIST IDX files in $src (apt-get install dataset-fashion-mnist)" >&2; exit 1; }
rm -rf .gpu/data && mkdir -p .gpu/data/fashion-mnist && cp "$src"/*-ubyte* .gpu/data/fashion-mnist/
du -sh .whl .gpu | sed 's/^/carried: /'
echo "next: run bench/gpu/session.sh on the device machine with carry [\".whl\", \".gpu\"]"
