#!/bin/bash
# nvidia-h200, session 7, call 5: final single-GPU numbers of the one-pass combine: floor ratios (eager, twice, CUDA graph), longest sequences, GPU tests
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=$OUT/work/call5; mkdir -p $W
finish() { tar czf $OUT/s7e.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
nvidia-smi > $W/nvidia-smi.txt
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; local rc=$?; echo "$name rc=$rc"; tail -${TAILN:-3} $W/$name.log; return $rc; }
F="python3 benchmarks/core/benchmark_implementations.py --batch-size 1 --num-heads 16 --head-dim 128 --no-progress --implementations improved --seq-lengths 32k,128k,1M --floor --reps 10"
run floor 150 $F --mode fwd,fwd_bwd --output $W/benchmark_implementations-floor.jsonl
run floor_graph 120 $F --mode fwd --cuda-graph --output $W/benchmark_implementations-floor-graph.jsonl
run floor_again 120 $F --mode fwd --seq-lengths 32k,128k,1M,32k,128k --output $W/benchmark_implementations-floor-again.jsonl
grep -h "improved " $W/floor.log $W/floor_graph.log $W/floor_again.log
X="python3 benchmarks/specialized/benchmark_extreme_sequences.py --no-progress --implementation improved --find-max --reps 3 --warmup 1"
TAILN=4 run findmax_fwd 120 $X --min-seq-length 4M --max-seq-length 4M --granularity 512k --output $W/benchmark_extreme_sequences-improved-fwd.jsonl
TAILN=4 run findmax_fwd_bwd 120 $X --mode fwd_bwd --min-seq-length 2M --max-seq-length 2M --granularity 256k --output $W/benchmark_extreme_sequences-improved-fwd_bwd.jsonl
cat $W/*find_max.json
TAILN=4 run tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_dilated.py -k "gpu or cuda"
