#!/bin/bash
# The lent GPU's one call (issue 38): batched clients on CUDA, then each paper table probed at paper scale.
# PY: the python that holds torch (python3 on the device machine); OUT: where results go back.
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
T0=$(date +%s)
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# the installed layout (pyproject's package-dir): server/, exporters/, firmware_profiles/ live inside edgefl
# (this is the device's copy of the tree: links inside edgefl/ give that layout without installing)
for d in server exporters firmware_profiles; do [ -e edgefl/$d ] || ln -s ../$d edgefl/$d; done
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} EDGEFL_DATA=$PWD/.gpu/data PYTHONUNBUFFERED=1
R=bench/results
pack() { tar -czf "$OUT/results.tgz" --exclude='*.safetensors' --exclude='models' $R 2>/dev/null; echo "[$(( $(date +%s) - T0 )) s] packed"; }
nvidia-smi -L 2>&1
$PY -c 'import torch, edgefl; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")' || exit 1
echo "== batched clients, one local epoch (12 batches of 50) of 100 ResNet18 clients"
timeout ${BATCH_S:-120} $PY bench/batched_clients.py --steps ${STEPS:-12} --only fedavg-100-resnet18 && cp $R/batched_clients.json $R/batched_clients-epoch.json; pack
echo "== batched clients, the default rounds (2 batches)"
timeout ${BATCH2_S:-45} $PY bench/batched_clients.py; pack
for spec in "fedhe||30" "fedin|fedin-iid-s0|75" "felo-velo|felo-iid-s0,velo-iid-s0,fedavg-iid-s0|35" "fedmho|fedmho-a0.5-s0|45"; do
  t=${spec%%|*}; rest=${spec#*|}; c=${rest%%|*}; P=${PROBE_S:-${rest#*|}}
  echo "== probe $t (${c:-all cells}) [$(( $(date +%s) - T0 )) s]"
  timeout $(( P * 4 + 60 )) $PY bench/paper.py $t --scale ${SCALE:-paper} --device ${DEVICE:-cuda} ${c:+--cells $c} --probe $P $EXTRA; pack
done
for f in $R/paper/*/probe/*.log; do echo "--- $f"; tail -n 4 "$f"; done
echo "done in $(( $(date +%s) - T0 )) s"
