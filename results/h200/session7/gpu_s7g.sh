#!/bin/bash
# nvidia-h200, session 7, call 7: the same configurations twice in one run with --warmup-s 1 (steady state at the power cap), GPU state recorded
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=$OUT/work/call7; mkdir -p $W
finish() { tar czf $OUT/s7g.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; local rc=$?; echo "$name rc=$rc"; tail -${TAILN:-3} $W/$name.log; return $rc; }
F="python3 benchmarks/core/benchmark_implementations.py --batch-size 1 --num-heads 16 --head-dim 128 --no-progress --implementations improved --floor --reps 10"
run again_warm 150 $F --mode fwd --seq-lengths 32k,128k,1M,32k,128k --warmup-s 1 --output $W/benchmark_implementations-floor-again-warmup1s.jsonl
run bwd_warm 100 $F --mode fwd_bwd --seq-lengths 32k,128k,32k,128k --warmup-s 1 --output $W/benchmark_implementations-floor-fwd_bwd-again-warmup1s.jsonl
for f in $W/*.jsonl; do echo $f; python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); g=r.get('gpu_state') or {}
    print(r['config']['seq_len'], r['mode'], round(r['time_ms']['median'],3), round(r['kernel_floor_ms']['median'],3), round(r['floor_ratio'],4), r['check']['passed'], (g.get('before') or {}).get('sm_clock_mhz'), (g.get('after') or {}).get('sm_clock_mhz'), [round(x,2) for x in r['samples_ms']])
" $f; done
