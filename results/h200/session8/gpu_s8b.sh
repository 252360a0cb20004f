#!/bin/bash
# nvidia-h200, session 8, call 2: repeats in one run at a steady state (fwd 1 s / 2 s, fwd_bwd 2 s + 4 s, 32K three times);
# multihead --find-max on the current code (the committed rows of the NaN bug are superseded by it)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=$OUT/work/call2; mkdir -p $W
finish() { kill $SMI 2>/dev/null; tar czf $OUT/s8b.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
nvidia-smi > $W/nvidia-smi.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv -lms 200 > $W/smi_trace.csv 2>&1 &
SMI=$!
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; local rc=$?; echo "$name rc=$rc"; tail -${TAILN:-3} $W/$name.log; return $rc; }
F="python3 benchmarks/core/benchmark_implementations.py --batch-size 1 --num-heads 16 --head-dim 128 --no-progress --implementations improved --floor --reps 10"
TAILN=6 run again_fwd_1s 120 $F --mode fwd --seq-lengths 32k,128k,1M,32k,128k,1M --warmup-s 1 --rep-s 1 --output $W/benchmark_implementations-floor-again-steady1s.jsonl
TAILN=6 run again_fwd_2s 120 $F --mode fwd --seq-lengths 32k,128k,1M,32k,128k,1M --warmup-s 2 --rep-s 2 --output $W/benchmark_implementations-floor-again-steady.jsonl
TAILN=6 run again_fwd_bwd 150 $F --mode fwd_bwd --seq-lengths 32k,32k,128k,1M,32k,128k,1M --warmup-s 2 --rep-s 4 --output $W/benchmark_implementations-floor-fwd_bwd-again-steady4s.jsonl
TAILN=12 run multihead_find_max 300 python3 benchmarks/specialized/benchmark_extreme_sequences.py --no-progress --implementation multihead --min-seq-length 1M --max-seq-length 2M --find-max --granularity 256k --max-call-seconds 10 --output $W/benchmark_extreme_sequences-multihead-fwd.jsonl
for f in $W/benchmark_implementations*.jsonl; do echo $f; python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); g=r.get('gpu_state') or {}
    print(r['config']['seq_len'], r['mode'], round(r['time_ms']['median'],3), round(r['kernel_floor_ms']['median'],3), round(r['floor_ratio'],4), r['check']['passed'], r['time_ms']['n'], (g.get('after') or {}).get('sm_clock_mhz'))
" $f; done
