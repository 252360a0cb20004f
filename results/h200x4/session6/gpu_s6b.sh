#!/bin/bash
# nvidia-h200-x4, session 6, call 1: ring attention with copy-engine pulls vs send/recv vs context_parallel
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT/work/call1; mkdir -p $W
finish() { tar czf $OUT/s6b.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
nvidia-smi > $W/nvidia-smi.txt
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; local rc=$?; echo "$name rc=$rc"; tail -${TAILN:-3} $W/$name.log; return $rc; }
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=4"
P="--no-progress --warmup 1 --reps 3 --time-budget 3"
R=ring,ring_zigzag,ring_zigzag_p2p,ring_zigzag_no_overlap
run correct_noncausal 60 $TR benchmarks/core/benchmark_distributed.py $P --seq-lengths 2k --num-heads 8 --world-sizes 2,4 --mode fwd_bwd --implementations $R --output $W/benchmark_distributed-correctness.jsonl || exit 1
run correct_causal 60 $TR benchmarks/core/benchmark_distributed.py $P --seq-lengths 2k --num-heads 8 --world-sizes 2,4 --mode fwd_bwd --causal --implementations $R --output $W/benchmark_distributed-correctness.jsonl || exit 1
grep -c '"passed": true' $W/benchmark_distributed-correctness.jsonl; grep -c '"passed": false' $W/benchmark_distributed-correctness.jsonl
TAILN=14 run ring_cp_256k_fwd 90 $TR benchmarks/specialized/benchmark_ring_attention.py $P --seq-lengths 256k --world-sizes 2,4 --causal --mode fwd --implementations ring_zigzag,ring_zigzag_p2p,ring_zigzag_no_overlap,torch_cp --timeout 60 --output $W/benchmark_ring_attention-256k-fwd.jsonl
TAILN=12 run ring_cp_256k_fwd_bwd 150 $TR benchmarks/specialized/benchmark_ring_attention.py $P --seq-lengths 256k --world-sizes 2,4 --causal --mode fwd_bwd --implementations ring_zigzag,ring_zigzag_p2p,torch_cp --timeout 60 --output $W/benchmark_ring_attention-256k-fwd_bwd.jsonl
TAILN=12 run ring_cp_512k_fwd 120 $TR benchmarks/specialized/benchmark_ring_attention.py $P --seq-lengths 512k --world-sizes 2,4 --causal --mode fwd --implementations ring_zigzag,ring_zigzag_p2p,torch_cp --timeout 60 --output $W/benchmark_ring_attention-512k-fwd.jsonl
