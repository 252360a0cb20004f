#!/bin/bash
# nvidia-h200-x4, session 6, call 2: ring 512K fwd_bwd and non-causal 256K
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT/work/call2; mkdir -p $W
finish() { tar czf $OUT/s6e.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
nvidia-smi > $W/nvidia-smi.txt
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; local rc=$?; echo "$name rc=$rc"; tail -${TAILN:-3} $W/$name.log; return $rc; }
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=4"
P="--no-progress --warmup 1 --reps 3 --time-budget 3"
TAILN=14 run ring_cp_512k_fwd_bwd 200 $TR benchmarks/specialized/benchmark_ring_attention.py $P --seq-lengths 512k --world-sizes 2,4 --causal --mode fwd_bwd --implementations ring_zigzag,ring_zigzag_p2p,torch_cp --timeout 90 --output $W/benchmark_ring_attention-512k-fwd_bwd.jsonl
TAILN=20 run ring_256k_noncausal 200 $TR benchmarks/specialized/benchmark_ring_attention.py $P --seq-lengths 256k --world-sizes 2,4 --mode fwd,fwd_bwd --implementations ring,ring_no_overlap,torch_cp --timeout 90 --output $W/benchmark_ring_attention-256k-noncausal.jsonl
