#!/usr/bin/env bash
# The GPU rows of benchmarks/throughput.md, run on a machine with a GPU (here: the `device`
# tool's lent machine, whose own image supplies torch, JAX, Flax, onnx-ir and transformers):
#
#   bash benchmarks/gpu_throughput.sh OUT_DIR [ITEMS] [STORE]
#
# ITEMS (default: batch 128 of every model, the seed's two first, then batch 1) are
# MODEL:BATCH pairs, each run in one fresh process: fp32 and bf16, inference and training
# step, every path on the GPU except onnxruntime (no CUDA provider there) and torch.compile
# (its compile of each model, batch and mode does not fit a device lease); to_jax at its
# default kernel layout only. The rows merge into OUT_DIR/throughput.json, a copy of STORE
# (default: the committed benchmarks/throughput.json), after each item, so a run stopped at
# its time limit keeps the items it finished (each took 70-190 s on an H200). Back on the
# development machine, copy OUT_DIR/throughput.json over benchmarks/throughput.json and
# rewrite the doc: bench_throughput.py --render.
# The PyPI peers (t2j, torchax) are read from $PEERS (default .dev/peers, carried along).
set -uo pipefail
out=${1:?usage: gpu_throughput.sh OUT_DIR [ITEMS] [STORE]}
items=${2:-bert:128 resnet50:128 transformer:128 cnn:128 bert:1 resnet50:1 transformer:1 cnn:1}
store=${3:-benchmarks/throughput.json}
cd "$(dirname "$0")/.."
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
# A copy of the tree (the device tool's came with a .git whose HEAD was not the tree's)
# stamps its rows with TREE_COMMIT: the commit of the clean tree it was copied from, as the
# sender checked it.
if [ -n "${TREE_COMMIT:-}" ]; then export XCONV_TREE_COMMIT=$TREE_COMMIT; fi
cp "$store" "$out/throughput.json"
# JAX must not take 75 % of the GPU at its first use: torch shares the process (and the
# parent process, which only asks jax.devices(), would hold that memory from the workers).
export XLA_PYTHON_CLIENT_PREALLOCATE=false HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "import torch, jax, flax, onnx_ir, transformers; print('torch', torch.__version__, torch.cuda.is_available(), 'jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'onnx_ir', onnx_ir.__version__, 'transformers', transformers.__version__)"
for item in $items; do
  echo "== ${item} ($(date -u +%H:%M:%S))"
  python3 benchmarks/bench_throughput.py --out "$out/throughput.md" --models "${item%%:*}" \
    --batches "${item##*:}" --train-all-batches --bf16-all-batches --no-compile --skip ort \
    --one-layout --repeat 10 --peers "${PEERS:-.dev/peers}" 2>&1 | tee -a "$out/log.txt" |
    grep -E "^\[|Error|wrote"
done
