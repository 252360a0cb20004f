#!/bin/bash
# nvidia-h200, session 7, call 6: the same configurations twice in one run, with the GPU's state recorded; then with --settle-s 5
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=$OUT/work/call6; mkdir -p $W
finish() { tar czf $OUT/s7f.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
nvidia-smi > $W/nvidia-smi.txt
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; local rc=$?; echo "$name rc=$rc"; tail -${TAILN:-3} $W/$name.log; return $rc; }
F="python3 benchmarks/core/benchmark_implementations.py --batch-size 1 --num-heads 16 --head-dim 128 --no-progress --implementations improved --seq-lengths 32k,128k,1M,32k,128k --floor --reps 10 --mode fwd"
run again 100 $F --output $W/benchmark_implementations-floor-again.jsonl
run again_settle 140 $F --settle-s 5 --output $W/benchmark_implementations-floor-again-settle5.jsonl
for f in $W/*.jsonl; do echo $f; python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); g=r.get('gpu_state') or {}
    print(r['config']['seq_len'], round(r['time_ms']['median'],3), round(r['kernel_floor_ms']['median'],3), round(r['floor_ratio'],4), g.get('before'), g.get('after'))
" $f; done
