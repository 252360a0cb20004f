#!/bin/bash
# nvidia-h200-x4, session 8: the harness's steady-state default (1 s warm-up + 1 s timed calls, go-on agreed across ranks)
# on NCCL; each configuration twice in one run: ring zigzag vs context_parallel 256K causal fwd, distributed dilated weak 256K/rank
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT/work/x4s8; mkdir -p $W
finish() { tar czf $OUT/x4s8.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
nvidia-smi > $W/nvidia-smi.txt
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; echo "$name rc=$?"; tail -${TAILN:-3} $W/$name.log; }
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=4"
TAILN=30 run weak_dilated 200 $TR benchmarks/core/benchmark_distributed.py --no-progress --time-budget 5 --scaling weak --seq-lengths 256k,256k --world-sizes 4,2,1 --mode fwd,fwd_bwd --implementations distributed_dilated --output $W/benchmark_distributed-weak-dilated-again.jsonl
TAILN=30 run ring_cp_256k_fwd 240 $TR benchmarks/specialized/benchmark_ring_attention.py --no-progress --time-budget 5 --seq-lengths 256k,256k --world-sizes 4,2 --causal --mode fwd --implementations ring_zigzag,torch_cp --timeout 60 --output $W/benchmark_ring_attention-256k-fwd-again.jsonl
for f in $W/*.jsonl; do echo $f; python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    print(r['implementation'], r.get('world_size'), r['config']['seq_len'], r['mode'], r['status'], round(r['time_ms']['median'],3) if r.get('time_ms') else None, r['time_ms'].get('n') if r.get('time_ms') else None, round(r.get('tflops') or 0), (r.get('check') or {}).get('passed'), r.get('scaling_efficiency', r.get('efficiency')))
" $f; done
