#!/bin/bash
# nvidia-h200, session 7, call 3: combine alone (session 6 vs two passes with L optional), ncu of it at 32K
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=$OUT/work/call3; mkdir -p $W
finish() { tar czf $OUT/s7c.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; local rc=$?; echo "$name rc=$rc"; tail -${TAILN:-3} $W/$name.log; return $rc; }
TAILN=30 run s7tune 200 python3 scratch/s7tune.py
TAILN=5 run ncu 200 ncu --clock-control none -k regex:_combine_kernel --launch-skip 3 --launch-count 3 --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats python3 scratch/s7ncu.py
grep -E "_combine_kernel|Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Stall|L1/TEX Hit|L2 Hit|Block Limit" $W/ncu.log | head -80
