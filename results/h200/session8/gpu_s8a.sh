#!/bin/bash
# nvidia-h200, session 8, call 1: GPU tests of the final combine (a801660); the same configurations twice in one run with
# time-based warm-up and timed calls (--warmup-s 2 --rep-s 2), an nvidia-smi trace of clocks and power all along
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=$OUT/work/call1; mkdir -p $W
finish() { kill $SMI 2>/dev/null; tar czf $OUT/s8a.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
nvidia-smi > $W/nvidia-smi.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv -lms 200 > $W/smi_trace.csv 2>&1 &
SMI=$!
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; local rc=$?; echo "$name rc=$rc"; tail -${TAILN:-3} $W/$name.log; return $rc; }
F="python3 benchmarks/core/benchmark_implementations.py --batch-size 1 --num-heads 16 --head-dim 128 --no-progress --implementations improved --floor --reps 10"
run tests 200 python3 -m pytest -q tests/test_dilated.py tests/test_layout.py -k "gpu or cuda"
TAILN=12 run again_fwd 200 $F --mode fwd --seq-lengths 32k,128k,1M,32k,128k,1M --warmup-s 2 --rep-s 2 --output $W/benchmark_implementations-floor-again-steady.jsonl
TAILN=12 run again_fwd_bwd 200 $F --mode fwd_bwd --seq-lengths 32k,128k,1M,32k,128k,1M --warmup-s 2 --rep-s 2 --output $W/benchmark_implementations-floor-fwd_bwd-again-steady.jsonl
for f in $W/*.jsonl; do echo $f; python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); g=r.get('gpu_state') or {}
    print(r['config']['seq_len'], r['mode'], round(r['time_ms']['median'],3), round(r['kernel_floor_ms']['median'],3), round(r['floor_ratio'],4), r['check']['passed'], r['time_ms']['n'], (g.get('before') or {}).get('sm_clock_mhz'), (g.get('after') or {}).get('sm_clock_mhz'), (g.get('after') or {}).get('power_w'))
" $f; done
