#!/bin/bash
# nvidia-h200, session 6, call 3: floor ratios after the cached resolution (fast host path), eager twice and CUDA graph
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=$OUT/work/call3; mkdir -p $W
finish() { tar czf $OUT/s6i.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
nvidia-smi > $W/nvidia-smi.txt
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; local rc=$?; echo "$name rc=$rc"; tail -${TAILN:-3} $W/$name.log; return $rc; }
F="python3 benchmarks/core/benchmark_implementations.py --batch-size 1 --num-heads 16 --head-dim 128 --no-progress --implementations improved --seq-lengths 32k,128k,1M --floor --reps 10"
TAILN=12 run floor 150 $F --mode fwd,fwd_bwd --output $W/benchmark_implementations-floor.jsonl
TAILN=8 run floor_graph 120 $F --mode fwd --cuda-graph --output $W/benchmark_implementations-floor-graph.jsonl
TAILN=8 run floor_again 120 $F --mode fwd --output $W/benchmark_implementations-floor-again.jsonl
TAILN=4 run tests 130 python3 -m pytest -q tests/test_dilated.py -k "gpu_in_place or (gpu_bf16 and improved)"
