#!/usr/bin/env bash
# One node: every GPU it has (or NPROC CPU processes with gloo when it has none).
#
#   launch/torchrun.sh benchmarks/core/benchmark_distributed.py --seq-lengths 256k,1M --causal
#   NPROC=4 launch/torchrun.sh benchmarks/specialized/benchmark_ring_attention.py
#
# Environment: NPROC (default: the GPU count, else 2), PYTHON (default python3), MASTER_PORT.
set -euo pipefail
PYTHON=${PYTHON:-python3}
if [ $# -lt 1 ]; then
    echo "usage: $0 BENCHMARK_SCRIPT [ARGS...]" >&2
    exit 2
fi
NPROC=${NPROC:-$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 2)")}
cd "$(dirname "$0")/.."
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" "$@"
