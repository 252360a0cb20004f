#!/bin/bash
# nvidia-h200, session 7, call 4: combine alone (session 6 / two passes / one pass, L stored or not), then the step over its floor
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=$OUT/work/call4; mkdir -p $W
finish() { tar czf $OUT/s7d.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; local rc=$?; echo "$name rc=$rc"; tail -${TAILN:-3} $W/$name.log; return $rc; }
TAILN=20 run s7tune 200 python3 scratch/s7tune.py
F="python3 benchmarks/core/benchmark_implementations.py --batch-size 1 --num-heads 16 --head-dim 128 --no-progress --implementations improved --seq-lengths 32k,128k,1M --floor --reps 10"
run floor 150 $F --mode fwd,fwd_bwd --output $W/benchmark_implementations-floor.jsonl
grep -h "improved " $W/floor.log
