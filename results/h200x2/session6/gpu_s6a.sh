#!/bin/bash
# nvidia-h200-x2, session 6, call 1: does K/V transfer slow the attention kernel? (NCCL vs copy engine)
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT/work/s6a; mkdir -p $W
finish() { tar czf $OUT/s6a.tgz -C $OUT/work . && rm -rf $OUT/work; }
trap finish EXIT
nvidia-smi topo -m > $W/topo.txt
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=2"
( timeout 150 $TR scratch/s6overlap.py ) > $W/overlap.log 2>&1; echo rc=$?; cat $W/overlap.log | grep -v Warning | tail -20
( NQ=131072 NK=65536 timeout 200 $TR scratch/s6overlap.py ) > $W/overlap128k.log 2>&1; echo rc=$?; tail -14 $W/overlap128k.log
