#!/bin/bash
# nvidia-h200-x4, session 7: distributed dilated (weak 256K/rank, 16M on 4) and correctness on the one-pass combine; copy-engine ring test on 4 GPUs
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT/work/x4s7; mkdir -p $W
finish() { tar czf $OUT/x4s7.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
nvidia-smi > $W/nvidia-smi.txt
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; echo "$name rc=$?"; tail -${TAILN:-3} $W/$name.log; }
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=4"
P="--no-progress --warmup 1 --reps 3 --time-budget 3"
run correct_noncausal 70 $TR benchmarks/core/benchmark_distributed.py $P --seq-lengths 2k --num-heads 8 --world-sizes 4,2 --mode fwd_bwd --output $W/benchmark_distributed-correctness.jsonl
run correct_causal 70 $TR benchmarks/core/benchmark_distributed.py $P --seq-lengths 2k --num-heads 8 --world-sizes 4,2 --mode fwd_bwd --causal --output $W/benchmark_distributed-correctness.jsonl
TAILN=24 run weak_dilated 110 $TR benchmarks/core/benchmark_distributed.py --no-progress --warmup 1 --reps 5 --time-budget 3 --scaling weak --seq-lengths 256k --world-sizes 4,2,1 --mode fwd,fwd_bwd --implementations distributed_dilated --output $W/benchmark_distributed-weak-dilated.jsonl
TAILN=6 run weak_16M 80 $TR benchmarks/core/benchmark_distributed.py $P --scaling weak --seq-lengths 4M --world-sizes 4,1 --implementations distributed_dilated --output $W/benchmark_distributed-weak-4M.jsonl
TAILN=4 run tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py -k "copy_engine"
