#!/bin/bash
# nvidia-h200-x4, session 8, call 4: ring backward adding each rank's dK/dV into the received accumulator in place
# (one pass a step, no memset): correctness at 2K on 4 and 2 GPUs, then 512K non-causal fwd_bwd at P=4 against context_parallel
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT/work/call4; mkdir -p $W
finish() { tar czf $OUT/x4s8d.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; echo "$name rc=$?"; tail -${TAILN:-3} $W/$name.log; }
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=4"
P="--no-progress --warmup 1 --reps 3 --time-budget 3"
run correct 90 $TR benchmarks/core/benchmark_distributed.py $P --seq-lengths 2k --num-heads 8 --world-sizes 4,2 --mode fwd_bwd --implementations ring,ring_zigzag --output $W/benchmark_distributed-correctness.jsonl
run correct_causal 90 $TR benchmarks/core/benchmark_distributed.py $P --seq-lengths 2k --num-heads 8 --world-sizes 4,2 --mode fwd_bwd --causal --implementations ring,ring_zigzag --output $W/benchmark_distributed-correctness.jsonl
TAILN=20 run ring_512k_noncausal_bwd 240 $TR benchmarks/specialized/benchmark_ring_attention.py --no-progress --time-budget 5 --seq-lengths 512k --world-sizes 4 --mode fwd_bwd --implementations ring,torch_cp --timeout 120 --output $W/benchmark_ring_attention-512k-noncausal-fwd_bwd.jsonl
python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); print(r['implementation'], r.get('world_size'), r['config']['causal'], r['mode'], r['status'], (r.get('check') or {}).get('passed'), (r.get('check') or {}).get('grad_rel_err'))
" $W/benchmark_distributed-correctness.jsonl
