#!/bin/bash
# nvidia-h200, session 7, call 2: combine kernel alone, session 6 vs one pass
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=$OUT/work/call2; mkdir -p $W
finish() { tar czf $OUT/s7b.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" >> $W/COMMANDS.log; ( time timeout $t "$@" ) > $W/$name.log 2>&1; local rc=$?; echo "$name rc=$rc"; tail -${TAILN:-3} $W/$name.log; return $rc; }
TAILN=30 run s7tune 200 python3 scratch/s7tune.py
