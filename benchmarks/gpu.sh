#!/usr/bin/env bash
# Single-GPU training throughput of a 1.1B Llama (TinyLlama-1.1B shapes), bf16, sequence 2048:
# mesh3d vs a plain PyTorch loop, SDPA / flash-attn, eager / torch.compile; tokens/s, MFU and
# peak memory per variant, raw numbers in benchmarks/results/local/gpu.json (--publish: the tracked
# benchmarks/results/gpu.json). A few minutes on one GPU.
#
#   bash benchmarks/gpu.sh                 # all variants
#   bash benchmarks/gpu.sh --steps 12      # more steps per variant; extra key=value overrides too
#   bash benchmarks/gpu.sh --dry-run       # the plan and configs, no GPU needed
#
# Without a GPU it prints a message and exits 0. See benchmarks/gpu.py for the details. On a GPU it
# then runs benchmarks/async_checkpoint.py (sync vs asynchronous checkpoint saves) on CUDA,
# benchmarks/model_constants.py and kernel_bytes.py --device cuda (the plan's step-time model
# against this GPU), and with 2+ GPUs benchmarks/overlap.py (zero 0's buckets vs the flat
# all-reduce) with NCCL.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
# fewer allocator retries on a 1B model with long sequences (available since torch 2.1)
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
python benchmarks/gpu.py "$@"
# the training time an asynchronous checkpoint save loses when the step runs on the GPU (the CPU
# measurement is bounded by the writer thread competing with a CPU-bound step; here it should not)
if python -c "import sys, torch; sys.exit(not torch.cuda.is_available())" && [[ " $* " != *" --dry-run "* ]]; then
    python benchmarks/async_checkpoint.py --rounds 3 mesh3d.device=cuda
    # the step-time model's constants on this GPU (matmul, memory, attention, one Llama-3-8B
    # layer eager and compiled: model speed / measured), and inductor's CUDA kernels' bytes
    python benchmarks/model_constants.py || echo "model_constants.py: exit $?, see above; gpu.sh goes on"
    python benchmarks/kernel_bytes.py --device cuda
    # zero_stage 0's bucketed gradient sum vs the flat all-reduce, on 2 (and 4) GPUs with NCCL
    if python -c "import sys, torch; sys.exit(torch.cuda.device_count() < 2)"; then
        python benchmarks/overlap.py --device cuda --rounds 6
    fi
fi
