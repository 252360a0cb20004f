#!/bin/bash
# nvidia-h200-x4, session 7, call 2: 16M tokens on 4 GPUs (distributed dilated, forward), longer limit, stack dump if it hangs
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT/work/x4s7b; mkdir -p $W
finish() { tar czf $OUT/x4s7b.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; echo "$name rc=$?"; tail -${TAILN:-3} $W/$name.log; }
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=4"
P="--no-progress --warmup 1 --reps 3 --time-budget 3"
PYTHONPATH=$PWD/scratch/fh:$PWD HANG_S=150 TAILN=12 run weak_16M 190 $TR benchmarks/core/benchmark_distributed.py $P --scaling weak --seq-lengths 4M --world-sizes 4,1 --implementations distributed_dilated --output $W/benchmark_distributed-weak-4M.jsonl
