#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 120 python3 scratch/s6gap.py 2>&1 | grep -v Warn | tail -8
gzip $OUT/*.json; ls -la $OUT
