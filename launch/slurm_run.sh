#!/usr/bin/env bash
# The body of the sbatch scripts in this folder: start a benchmark on every node of the allocation.
#
#   slurm_run.sh torchrun SCRIPT [ARGS...]   srun starts one torchrun per node (c10d rendezvous
#                                            on the allocation's first host)
#   slurm_run.sh srun SCRIPT [ARGS...]       srun starts every rank itself; dilated reads RANK,
#                                            WORLD_SIZE, LOCAL_RANK from SLURM_PROCID, SLURM_NTASKS,
#                                            SLURM_LOCALID (for clusters that forbid torchrun)
#
# Results go to RUN_DIR (default results/slurm/<job id>/) as results.jsonl plus the job's log.
# Environment: NPROC_PER_NODE (default: GPUs on the node, else 2), PYTHON, MASTER_PORT, RUN_DIR.
set -euo pipefail
MODE=${1:?usage: slurm_run.sh torchrun|srun SCRIPT [ARGS...]}
shift
SCRIPT=${1:-benchmarks/core/benchmark_distributed.py}
shift || true
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
PYTHON=${PYTHON:-python3}
RUN_DIR=${RUN_DIR:-results/slurm/${SLURM_JOB_ID:-local}}
mkdir -p "$RUN_DIR"
if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE=${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}
    [ "$NPROC_PER_NODE" -gt 0 ] 2>/dev/null || NPROC_PER_NODE=2
fi
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}

# NCCL: uncomment what your cluster needs.
# export NCCL_DEBUG=INFO                # log rings/trees and transports
# export NCCL_SOCKET_IFNAME=ib0         # the interface for bootstrap traffic
# export NCCL_IB_HCA=mlx5               # which InfiniBand adapters to use
# export NCCL_NVLS_ENABLE=0             # NVLink SHARP/multicast off (some H200 hosts need it off)
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1

echo "job ${SLURM_JOB_ID:-?}: $SLURM_NNODES node(s) x $NPROC_PER_NODE, rendezvous $MASTER_ADDR:$MASTER_PORT," \
     "$SCRIPT $*, results in $RUN_DIR"
case "$MODE" in
torchrun)
    srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
        "$PYTHON" -m torch.distributed.run --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE" \
        --rdzv_id="${SLURM_JOB_ID:-0}" --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
        "$SCRIPT" --output "$RUN_DIR/results.jsonl" "$@"
    ;;
srun)
    srun --ntasks-per-node="$NPROC_PER_NODE" --kill-on-bad-exit=1 \
        "$PYTHON" "$SCRIPT" --output "$RUN_DIR/results.jsonl" "$@"
    ;;
*)
    echo "unknown mode $MODE (torchrun or srun)" >&2
    exit 2
    ;;
esac
echo "results: $RUN_DIR/results.jsonl"
