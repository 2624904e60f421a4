#!/usr/bin/env bash
# The GPU variant of the benchmark, for one CUDA device: SmolLM2-135M, bf16,
# full fine-tune, ours (both backward modes) against upstream torchtune 0.6.1,
# gradient accumulation 1 and 8, two repeats after a warm-up. Sized to finish
# in under 10 minutes on an H100/H200-class GPU (about 15 short runs).
#
#   bash bench/gpu_bench.sh              # from the repository root
#   bash bench/gpu_bench.sh --realistic  # batch 8 x GA 4 x 512 tokens, grouping on/off (issue 13)
#
# Needs the project installed and its assets in assets/ (python -m
# torchtune_ext.download on a machine with access to the package registry;
# copy assets/ over if the GPU machine has none). Writes
# bench/results/gpu.json and bench/results/gpu.md (--realistic: gpu_realistic.json/.md,
# full fine-tune, upstream vs ours with backward once / per micro-batch and
# with group_by_length off, 2 repeats of 12 steps after a warm-up).
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

profile=--gpu
if [ "${1:-}" = "--realistic" ]; then
    profile=--gpu-realistic
    shift
fi
# A GPU machine is not shared with other jobs: do not wait for the CPUs to go quiet.
exec timeout 570 python -m bench "$profile" --wait-quiet-s 0 --max-redo 0 "$@"
