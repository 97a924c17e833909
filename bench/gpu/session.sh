#!/bin/bash
# On a lent GPU machine, in the repository root (issue 38): the GPU work still open, each step
# time-boxed so the whole call ends inside BUDGET_S, every result copied to $OUT as it is written.
#
#   bench/gpu/prepare.sh                 # here first: wheels and data to carry
#   run: bash bench/gpu/session.sh       # there, with carry [".whl", ".gpu"] and timeout_s 600
#
# Steps (STEPS, in order; default "batched fedmho"):
#   batched  bench/batched_clients.py --steps 12 --only fedavg-100-resnet18: 100 FedAvg ResNet18
#            clients' local epoch, batched against one at a time, local training timed alone
#            (issue 38's goal: at least 10x)
#   fedmho   bench/fedmho_table4.py --paper --device cuda --alpha 0.1: Table IV's Dirichlet 0.1
#            column at the paper's scale (full-width VGG-9 clients, 200 epochs), the column whose
#            ordering fails at CPU scale; saved after every stage, so a cut-off run keeps what it did
#   probe    bench/paper.py fedmho --scale paper --probe 60 (planning numbers only)
# Env: PY (python with torch; python3), OUT (results; /tmp/gpu-out), BUDGET_S (540), ALPHA (0.1),
#      BATCH_S (150: the batched step's limit), FEDMHO_ARGS (the scale; default
#      "--paper --device cuda --snapshots 50 100"; a CPU smoke run of this script gives a tiny one).
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu-out}
BUDGET_S=${BUDGET_S:-540}
STEPS=${STEPS:-batched fedmho}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# edgefl's installed layout (pyproject's package-dir maps server/, exporters/ and firmware_profiles/ into
# edgefl): links inside this copy of the tree give it without installing
for d in server exporters firmware_profiles; do [ -e edgefl/$d ] || ln -s ../$d edgefl/$d; done
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ -d .gpu/data ] && export EDGEFL_DATA=$PWD/.gpu/data
R=bench/results
keep() { for f in "$@"; do [ -f "$f" ] && cp "$f" "$OUT/"; done; }
nvidia-smi -L 2>&1 | tee "$OUT/gpu.txt"
$PY -c 'import torch, edgefl; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")' \
  | tee -a "$OUT/gpu.txt" || exit 1
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$OUT/gpu.txt"
for step in $STEPS; do
  case $step in
    batched)
      say "batched clients: 100 FedAvg ResNet18 clients, one local epoch (12 batches of 50)"
      timeout "${BATCH_S:-150}" $PY bench/batched_clients.py --steps 12 --only fedavg-100-resnet18 2>&1 | tee "$OUT/batched.log"
      keep $R/batched_clients.json ;;
    fedmho)
      a=${ALPHA:-0.1}; s=$(( $(left) - 20 ))
      say "FedMHO Table IV, Dirichlet $a, paper scale, for at most $s s"
      [ $s -gt 60 ] || { say "too little time left for FedMHO"; continue; }
      # snapshots at 50 and 100 epochs fuse MD and SD on the way (paper Fig. 7: little changes above about 50),
      # so a run the budget cuts off still says something at the paper's scale
      timeout --signal=TERM --kill-after=10 $s $PY bench/fedmho_table4.py ${FEDMHO_ARGS:---paper --device cuda --snapshots 50 100} \
        --alpha $a --variants FedMHO FedMHO-MD FedMHO-SD --no-small-prototype --tag paper-a$a --plot-dir "$OUT" 2>&1 | tee "$OUT/fedmho.log"
      keep $R/fedmho-paper-a$a.json ;;
    probe)
      s=$(( $(left) - 20 ))
      timeout --kill-after=10 $s $PY bench/paper.py fedmho --scale paper --device cuda --cells fedmho-md-a0.1-s0 --probe 60 2>&1 \
        | tee "$OUT/probe.log"
      keep $R/paper/fedmho-paper/probe.json ;;
    *) say "unknown step $step (batched, fedmho, probe)";;
  esac
done
say "done; in $OUT: $(ls "$OUT" | tr '\n' ' ')"
