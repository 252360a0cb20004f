#!/bin/bash
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT/work/call3; mkdir -p $W
( time timeout 150 python3 -m pytest -q tests/test_distributed.py -k "copy_engine or match_single" ) > $W/tests.log 2>&1; echo rc=$?; tail -15 $W/tests.log
cp -r $W $OUT/call3 && rm -rf $OUT/work
