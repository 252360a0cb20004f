#!/bin/bash
# nvidia-h200-x4, session 8, call 2: ring attention non-causal at 512K vs context_parallel, P=2 and 4, fwd and fwd_bwd (harness defaults)
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT/work/call2; mkdir -p $W
finish() { tar czf $OUT/x4s8b.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
nvidia-smi > $W/nvidia-smi.txt
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; echo "$name rc=$?"; tail -${TAILN:-3} $W/$name.log; }
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=4"
TAILN=40 run ring_512k_noncausal 480 $TR benchmarks/specialized/benchmark_ring_attention.py --no-progress --time-budget 5 --seq-lengths 512k --world-sizes 4,2 --mode fwd,fwd_bwd --implementations ring,torch_cp --timeout 120 --output $W/benchmark_ring_attention-512k-noncausal.jsonl
