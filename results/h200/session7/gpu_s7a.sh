#!/bin/bash
# nvidia-h200, session 7, call 1: one-pass combine with masked calls (kernel alone, then the step over its floor), GPU tests
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=$OUT/work/call1; mkdir -p $W
finish() { tar czf $OUT/s7a.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
nvidia-smi > $W/nvidia-smi.txt
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; local rc=$?; echo "$name rc=$rc"; tail -${TAILN:-3} $W/$name.log; return $rc; }
TAILN=30 run s7tune 150 python3 scratch/s7tune.py
F="python3 benchmarks/core/benchmark_implementations.py --batch-size 1 --num-heads 16 --head-dim 128 --no-progress --implementations improved --seq-lengths 32k,128k,1M --floor --reps 10"
TAILN=12 run floor 150 $F --mode fwd,fwd_bwd --output $W/benchmark_implementations-floor.jsonl
TAILN=8 run floor_again 120 $F --mode fwd --seq-lengths 32k,128k,32k,128k,32k --output $W/benchmark_implementations-floor-again.jsonl
TAILN=5 run tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_dilated.py tests/test_layout.py -k "gpu or cuda"
