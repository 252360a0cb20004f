"""Session 6 probe: how much does concurrent K/V transfer slow the attention kernel?
Per step: one cuDNN forward q[64K] x kv[32K] (B=1,H=16,D=128 bf16; the P=4, 256K zigzag step)
while a 2 x 64K x 16 x 128 bf16 block (537 MB) moves: none / NCCL p2p / NCCL p2p on a
high-priority group / copy-engine pull from the peer's symmetric buffer (normal, high priority)."""
import os, statistics, torch, torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from dilated.backends import get_backend
from dilated.distributed import init_distributed

rank, world, dev = init_distributed()
nq, nk, H, D = int(os.environ.get("NQ", 65536)), int(os.environ.get("NK", 32768)), 16, 128
g = torch.Generator(device=dev).manual_seed(rank)
q = torch.randn(1, nq, H, D, device=dev, dtype=torch.bfloat16, generator=g)
k = torch.randn(1, nk, H, D, device=dev, dtype=torch.bfloat16, generator=g)
v = torch.randn_like(k)
be = get_backend("sdpa_cudnn", q, k, False)
msg = 2 * nq * H * D  # a full local K and V block
send = torch.randn(msg, device=dev, dtype=torch.bfloat16, generator=g)
nxt, prv = (rank + 1) % world, (rank - 1) % world
opts = dist.ProcessGroupNCCL.Options(); opts.is_high_priority_stream = True
hp = dist.new_group(list(range(world)), pg_options=opts)
sym = symm_mem.empty(msg, dtype=torch.bfloat16, device=dev)
sym.copy_(send)
hdl = symm_mem.rendezvous(sym, dist.group.WORLD)
peer = hdl.get_buffer(prv, (msg,), torch.bfloat16)
recv = torch.empty_like(send)
side = torch.cuda.Stream(); side_hp = torch.cuda.Stream(priority=-1)
cur = torch.cuda.current_stream()

def nccl(group):
    ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
    return dist.batch_isend_irecv(ops)

def ce(stream):
    stream.wait_stream(cur)
    with torch.cuda.stream(stream):
        recv.copy_(peer)
    return stream

def step(mode):
    pend = None
    if mode == "nccl": pend = nccl(None)
    elif mode == "nccl_hp": pend = nccl(hp)
    elif mode == "ce": pend = ce(side)
    elif mode == "ce_hp": pend = ce(side_hp)
    be.forward(q, k, v, False, D ** -0.5)
    if isinstance(pend, list):
        for r in pend: r.wait()
    elif pend is not None:
        cur.wait_stream(pend)

def xfer(mode):
    if mode.startswith("nccl"):
        for r in nccl(None if mode == "nccl" else hp): r.wait()
    else:
        cur.wait_stream(ce(side if mode == "ce" else side_hp))

def timeit(fn, reps=6, steps=3):
    ts = []
    for i in range(reps + 1):
        hdl.barrier(); torch.cuda.synchronize(); dist.barrier()
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        for _ in range(steps): fn()
        b.record(); b.synchronize()
        if i: ts.append(a.elapsed_time(b) / steps)
    return statistics.median(ts), min(ts), max(ts)

res = {}
for mode in ["none", "nccl", "nccl_hp", "ce", "ce_hp", "none"]:
    res.setdefault(mode, []).append(timeit(lambda: step(mode)))
for mode in ["nccl", "nccl_hp", "ce", "ce_hp"]:
    res["xfer_" + mode] = [timeit(lambda: xfer(mode))]
ok = torch.equal(recv, peer)
bk = symm_mem.get_backend(dev)
if rank == 0:
    print(f"world={world} nq={nq} nk={nk} msg={msg*2/1e6:.0f} MB  pull equals peer: {ok} symm backend {bk}")
    for m, rs in res.items():
        for med, lo, hi in rs:
            extra = f"  ({msg*2/med/1e6:.0f} GB/s)" if m.startswith("xfer") else ""
            print(f"{m:12s} median {med:8.3f} ms  [{lo:.3f}, {hi:.3f}]{extra}")
hdl.barrier(); torch.cuda.synchronize()
dist.destroy_process_group()
