"""Workers for tests/parallel/test_distributed.py: real gloo process groups, no mocks."""
import datetime
import faulthandler
import functools
import itertools
import os
import warnings

import torch
import torch.distributed as dist

import dilated
from dilated.bench.memory import MiB, PeakMemory
from dilated.parallel import peer_copy
from dilated.reference import dense_reference


def init(rank, world, port, timeout_s=60):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def _full(seed, n, h, hkv, d=16, b=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, hh, d, generator=g) for hh in (h, hkv, hkv)]


def _check(name, got, ref, tol=2e-4):
    err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-3)).item()
    assert err < tol, f"{name}: rel err {err:.2e}"


def _compare(module, layout, q, k, v, ref_fn, name):
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(99))  # the same on every rank
    ql, kl, vl, dl = (dilated.shard(t, layout=layout).requires_grad_(t is not dout) for t in (q, k, v, dout))
    out = module(ql, kl, vl)
    out.backward(dl)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = ref_fn(qf, kf, vf)
    ref.backward(dout)
    _check(f"{name} out", dilated.unshard(out.detach(), layout=layout), ref.detach())
    for t, (local, full) in zip("qkv", ((ql, qf), (kl, kf), (vl, vf))):
        _check(f"{name} d{t}", dilated.unshard(local.grad, layout=layout), full.grad)


def correctness(rank, world, port):
    init(rank, world, port)
    n = 16 * world
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            for h, hkv in ((4, 4), (4, 2)):
                q, k, v = _full(7, n, h, hkv)
                ring = dilated.RingAttention(causal=causal, layout=layout, backend="manual")
                _compare(ring, layout, q, k, v,
                         lambda a, b_, c: dense_reference(a, b_, c, causal=causal, dtype=torch.float32)[0],
                         f"ring {layout} causal={causal} H={h}/{hkv}")
                # what a ring sends: K and V, one message each per step, P - 1 steps forward
                ring.stats.reset()
                ring(*(dilated.shard(t, layout=layout) for t in (q, k, v)))
                assert ring.stats.messages == 2 * (world - 1), ring.stats.as_dict()
                assert ring.transport_used == "p2p"  # copy-engine pulls need CUDA and NCCL
    try:
        dilated.RingAttention(transport="copy_engine")(*_full(1, 8, 2, 2))
        raise AssertionError("transport='copy_engine' ran on gloo")
    except ValueError as e:
        assert "copy_engine" in str(e) and "CUDA" in str(e) and "p2p" in str(e), e
    segs = [8, 16, n] if world == 2 else [8, 32, n]  # segments inside a shard, over 2 ranks, over all
    for causal in (False, True):
        for h, hkv, dils in ((4, 4, [1, 2, 4]), (6, 2, [1, 2, 3])):
            q, k, v = _full(11, n, h, hkv)
            mod = dilated.DistributedDilatedAttention(segs, dils, causal=causal, backend="manual")
            ref = dilated.DilatedAttention(segs, dils, causal=causal, backend="manual")
            _compare(mod, "contiguous", q, k, v, ref, f"distributed dilated causal={causal} H={h}/{hkv}")
            # one all-gather per branch that spans ranks (not one per head offset), nothing for local ones
            mod.stats.reset()
            mod(*(dilated.shard(t) for t in (q, k, v)))
            spanning = sum(1 for w in segs if w > n // world)
            assert mod.stats.collectives == spanning and mod.stats.messages == 0, mod.stats.as_dict()
    dist.destroy_process_group()


def sharded_check(rank, world, port):
    """The sampled check reading shards in place equals the one on gathered tensors."""
    from dilated.bench.distributed import ShardedSequence
    from dilated.reference import sampled_reference

    init(rank, world, port)
    n = 24 * world
    q, k, v = _full(5, n, 4, 2, b=1)
    mine = [dilated.shard(t) for t in (q, k, v)]
    sharded = [ShardedSequence(t) for t in mine]
    rows = torch.tensor([0, 5, n // 2 + 1, n - 1])
    assert torch.equal(sharded[0][:, rows], q[:, rows])
    assert torch.equal(sharded[1][:, 3:n - 2], k[:, 3:n - 2])
    segs, dils = [8, n], [1, 2]
    got = sampled_reference(*sharded, rows, causal=True, segment_lengths=segs, dilation_rates=dils, block=7)
    want = sampled_reference(q, k, v, rows, causal=True, segment_lengths=segs, dilation_rates=dils, block=7)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    dout = _full(6, n, 4, 4, b=1)[0]  # the query gradients of the sampled rows, dout in its shards too
    got = sampled_reference(*sharded, rows, causal=True, segment_lengths=segs, dilation_rates=dils, block=7,
                            dout=ShardedSequence(dilated.shard(dout)))
    want = sampled_reference(q, k, v, rows, causal=True, segment_lengths=segs, dilation_rates=dils, block=7, dout=dout)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6), (g - w).abs().max()
    dist.destroy_process_group()


def sharded_layouts(rank, world, port):
    """Past the gather limit the check reads the shards where they lie in any layout: its reads equal
    the gathered tensor's (which the contiguous layout's reads do not), and a documents row checked
    that way passes."""
    from dilated.bench import RunOptions, run_sweep
    from dilated.bench import distributed as bench_distributed
    from dilated.bench import runner
    from dilated.bench.distributed import ShardedSequence
    from dilated.bench.registry import Case, get_implementation

    init(rank, world, port)
    n = 48 * world
    case = Case(batch=1, seq_len=n, num_heads=12, head_dim=16, num_kv_heads=6, dtype="float32", causal=True,
                mode="fwd_bwd", documents="lognormal:16,1.0")
    rows = torch.tensor([0, 3, n // 2 + 1, n - 5, n - 1])
    limit = bench_distributed.GATHER_LIMIT_BYTES
    for name in ("ring_zigzag", "documents", "ulysses"):
        impl = get_implementation(name)
        model = impl.build(case, "manual")
        q, k, v = impl.inputs(case, "cpu", torch.Generator().manual_seed(3), False)
        model(q, k, v)  # the documents' layout is the call's
        full = impl.gather(q)
        bench_distributed.GATHER_LIMIT_BYTES = 0
        try:
            sharded = impl.gather(q)
        finally:
            bench_distributed.GATHER_LIMIT_BYTES = limit
        assert isinstance(sharded, ShardedSequence), name
        assert torch.equal(sharded[:, rows], full[:, rows]), name
        assert torch.equal(sharded[:, 5:n - 3], full[:, 5:n - 3]), name
        if name != "ulysses":  # reads as if the shards were contiguous get other rows
            assert not torch.equal(ShardedSequence(q)[:, rows], full[:, rows]), name
    bench_distributed.GATHER_LIMIT_BYTES, runner.DENSE_REFERENCE_LIMIT = 0, 0
    row = run_sweep([(get_implementation("documents"), case, "manual")],
                    RunOptions(warmup=1, reps=1, device="cpu"), None, "t", progress=False)[0]
    assert row["status"] == "ok" and row["check"]["passed"], row
    assert "sampled" in row["check"]["reference"] and row["check"]["grad_rel_err"] < 1e-4, row["check"]
    dist.destroy_process_group()


def measured_together(rank, world, port):
    """A step with a collective timed on several ranks: every call starts together (a rank that
    lingers after its collective does not lengthen the others' next call), and each call's time is the
    slowest rank's, the same on every rank."""
    import time

    from dilated.bench.timing import measure_together

    init(rank, world, port)
    t = torch.ones(1)

    def step():  # the last rank lingers after the collective
        dist.all_reduce(t)
        if rank == world - 1:
            time.sleep(0.03)

    slowest, own = measure_together(step, "cpu", warmup=1, reps=4, flush_l2=False)
    every = [None] * world
    dist.all_gather_object(every, slowest)
    assert all(x == every[0] for x in every) and len(slowest) == 4, every
    assert min(slowest) >= 30 and slowest == [max(a, b) for a, b in zip(slowest, own)], (slowest, own)
    if rank != world - 1:  # its calls did not wait for the lingering rank's last call
        assert max(own) < 20, own
    dist.destroy_process_group()


def calibrated_decode(rank, world, port):
    """The calibration times decode steps on one GPU and on the first 2, 4, ... ranks and the world, every
    rank returning the same points."""
    from dilated.bench.planner import measure

    init(rank, world, port)
    measure.DECODE_TOKENS, measure.DECODE_BATCHES = (64, 256), (1, 2)
    points = measure.measure_decode(torch.device("cpu"), shape=(4, 2, 16), reps=2, log=lambda *_: None)
    assert sorted({p.ranks for p in points}) == measure.decode_rank_counts(world)
    assert len(points) == 4 * len(measure.decode_rank_counts(world)) and all(p.ms > 0 for p in points), points
    assert not any(p.cuda_graph for p in points)  # CUDA graphs need a GPU: steps called from Python only
    every = [None] * world
    dist.all_gather_object(every, points)
    assert all(x == points for x in every)
    dist.destroy_process_group()


def bad_length(rank, world, port):
    init(rank, world, port)
    q = torch.randn(1, 5 * world + 1, 2, 8)
    try:
        dilated.shard(q, layout="contiguous")
    except ValueError as e:
        assert "divisible" in str(e)
    else:
        raise AssertionError("no ValueError for N not divisible by P")
    dist.destroy_process_group()


def dies(rank, world, port):
    init(rank, world, port, timeout_s=15)
    q = torch.randn(1, 8, 2, 8)
    ring = dilated.RingAttention(backend="manual")
    ring(q, q, q)
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    ring(q, q, q)  # rank 0 waits for rank 1 here until the timeout or until it is terminated
    dist.destroy_process_group()


def copy_engine_matches_p2p(rank, world, port):
    """On GPUs (NCCL): the ring's copy-engine pulls give what its send/recv ring gives, forward
    and backward, on the world group and on a subgroup, batch 2 (per-row pulls of half blocks).
    A rank still running after 150 s prints every thread's stack and exits: a hang of NCCL or of
    symmetric memory fails the test with where each rank waited, instead of running on."""
    faulthandler.dump_traceback_later(150, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=120))
    groups = [(world, None)] + ([(2, dist.new_group([0, 1]))] if world > 2 else [])
    for p, group in groups:  # the world first: see dilated.parallel.peer_copy.prepare
        if rank >= p:
            continue
        g = torch.Generator(device=dev).manual_seed(3)
        full = [torch.randn(2, 256 * p, hh, 64, device=dev, dtype=torch.bfloat16, generator=g) for hh in (4, 2, 2)]
        dout = torch.randn(full[0].shape, device=dev, dtype=torch.bfloat16, generator=g)
        n = 256 * p
        # packed documents: inside the chunks (steps between ranks pull nothing) or crossing them
        # (a step pulls the rows of the documents its queries meet)
        mixes = [None, list(range(0, n + 1, 64)), [0, 64, 200, n - 100, n]]
        for layout, causal, cu in itertools.product(("contiguous", "zigzag"), (False, True), mixes):
            got = {}
            for transport in ("copy_engine", "p2p"):
                ring = dilated.RingAttention(causal=causal, layout=layout, group=group, transport=transport)
                q, k, v = (dilated.shard(t, group=group, layout=layout).requires_grad_() for t in full)
                kw = {} if cu is None else {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
                ring.stats.reset()
                out = ring(q, k, v, **kw)
                pulled = ring.stats.bytes_sent  # the forward's blocks
                out.backward(dilated.shard(dout, group=group, layout=layout))
                assert ring.transport_used == transport
                got[transport] = [out.detach(), q.grad, k.grad, v.grad, pulled]
            for name, a, b in zip(("out", "dq", "dk", "dv"), got["copy_engine"], got["p2p"]):
                err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                where = f"P={p} {layout} causal={causal} cu={cu} {name}"
                assert err < 1e-2, f"{where}: copy engine vs p2p rel err {err:.2e}"
            if cu == mixes[1]:  # every document inside a chunk: no step between ranks pulls
                assert got["copy_engine"][4] == 0 < got["p2p"][4], (layout, causal, got["copy_engine"][4])
        # the symmetric buffer the pulls publish from (a shard's k and v at least) counts in a call's peak
        # memory, though torch's allocator leaves it out
        shard_kv = sum(t.numel() * t.element_size() for t in full[1:]) // p
        assert peer_copy.held_bytes(dev) >= shard_kv, (peer_copy.held_bytes(dev), shard_kv)
        ring = dilated.RingAttention(causal=True, group=group, transport="copy_engine")
        q, k, v = (dilated.shard(t, group=group, layout="contiguous") for t in full)
        with PeakMemory(dev) as mem:
            ring(q, k, v)
        allocator = torch.cuda.max_memory_allocated(dev)
        assert abs(mem.peak_total_mib * MiB - allocator - peer_copy.held_bytes(dev)) < 1, (mem.peak_total_mib, allocator)
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def timing_agrees(rank, world, port):
    """Time-based timing on ranks of different speeds: every rank takes the same number of calls."""
    import time

    from dilated.bench.timing import measure

    init(rank, world, port)

    def agree(more):
        t = torch.tensor([float(more)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() > 0

    samples = measure(lambda: time.sleep(0.002 * (1 + rank)), "cpu", warmup=1, reps=2, warmup_s=0.03,
                      rep_s=0.05, budget_s=0.2, agree=agree)
    counts = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([float(len(samples))]))
    assert len({c.item() for c in counts}) == 1, f"ranks took {counts} calls"
    dist.destroy_process_group()


def _every_other(x):
    """The values of ``x`` in a tensor whose last dimension has stride 2 (NaN in the gaps)."""
    wide = torch.full((*x.shape[:-1], 2 * x.shape[-1]), float("nan"))
    wide[..., ::2] = x
    return wide[..., ::2]


def strided_inputs(rank, world, port):
    """Ring and distributed dilated attention on shards whose head_dim is strided."""
    init(rank, world, port)
    n = 16 * world
    q, k, v = _full(3, n, 4, 2)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    cases = [(dilated.RingAttention(causal=True, layout="zigzag", backend="sdpa"), "zigzag",
              lambda a, b, c: dense_reference(a, b, c, causal=True)[0]),
             (dilated.DistributedDilatedAttention([8, n], [1, 2], causal=True, backend="sdpa"), "contiguous",
              lambda a, b, c: dilated.dilated_attention(a, b, c, [8, n], [1, 2], causal=True, backend="manual"))]
    for module, layout, ref_fn in cases:
        local = [_every_other(dilated.shard(t, layout=layout)).requires_grad_() for t in (q, k, v)]
        assert local[0].stride(-1) == 2
        out = module(*local)
        out.backward(dilated.shard(dout, layout=layout))
        full = [t.clone().double().requires_grad_() for t in (q, k, v)]
        ref = ref_fn(*full)
        ref.backward(dout.double())
        _check(f"{type(module).__name__} strided out", dilated.unshard(out.detach(), layout=layout), ref.detach())
        for t, mine, whole in zip("qkv", local, full):
            _check(f"{type(module).__name__} strided d{t}", dilated.unshard(mine.grad, layout=layout), whole.grad)
    dist.destroy_process_group()


def ranks_disagree(rank, world, port):
    """Ranks that call with disagreeing inputs or settings all get a clear error, at once."""
    import time

    init(rank, world, port, timeout_s=60)
    t0 = time.time()
    g = torch.Generator().manual_seed(rank)
    x = lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    odd = rank == world - 1
    cases = [  # (what differs, module, inputs on this rank)
        ("q", dilated.RingAttention(backend="manual"),
         [x(1, 8, 4, 8) if odd else x(1, 16, 2, 8)] * 3),  # same numel, another shape
        ("dtype", dilated.RingAttention(backend="manual"), [x(1, 8, 2, 8, dtype=torch.float64 if odd else torch.float32)] * 3),
        ("causal", dilated.RingAttention(causal=odd, backend="manual"), [x(1, 8, 2, 8)] * 3),
        ("layout", dilated.RingAttention(layout="zigzag" if odd else "contiguous", backend="manual"), [x(1, 8, 2, 8)] * 3),
        ("dilation_rates", dilated.DistributedDilatedAttention([4, 16], [1, 4 if odd else 2], backend="manual"),
         [x(1, 8, 2, 8)] * 3),
        ("error", dilated.RingAttention(backend="manual"), [x(1, 8, 2, 8)] * 2 + [x(1, 8, 2) if odd else x(1, 8, 2, 8)]),
    ]
    for what, module, inputs in cases:
        try:
            module(*inputs)
        except dilated.RankMismatchError as e:
            msg = str(e)
            if what == "error":
                assert not odd and f"rank {world - 1}" in msg and "4 dimensions" in msg, msg
            else:
                assert what in msg and f"rank {world - 1}" in msg, msg
        except ValueError as e:  # the rank whose own input is invalid raises its own error
            assert what == "error" and odd and "4 dimensions" in str(e), e
        else:
            raise AssertionError(f"rank {rank}: no error when ranks disagree on {what}")
    # the functional form gives the module's result and, like it, compares inputs once per signature
    qf = torch.randn(1, 8, 2, 8, generator=torch.Generator().manual_seed(rank))
    ref = dilated.RingAttention(causal=True, layout="zigzag", backend="manual")(qf, qf, qf)
    for _ in range(2):
        got = dilated.ring_attention(qf, qf, qf, causal=True, layout="zigzag", backend="manual")
        assert torch.equal(got, ref)
    try:
        dilated.ring_attention(qf if rank else qf[:, :4], qf, qf, backend="manual")
        raise AssertionError("ring_attention ran with disagreeing shapes")
    except ValueError as e:
        assert "disagree" in str(e) or "one length" in str(e), e
    # the group is still usable, and an agreed signature is checked once, not per call
    ring = dilated.RingAttention(backend="manual")
    same = torch.randn(1, 8, 2, 8, generator=torch.Generator().manual_seed(0))
    ring(same, same, same)
    ring(same, same, same)
    assert len(ring._agreed) == 1
    # packed documents that change every call (training): the record of agreed signatures stays bounded
    n = 8 * world
    packings = [[0, a, b, n] for a in range(1, n) for b in range(a + 1, n)][:ring._agreed.capacity + 6]
    for cu in packings:
        ring(same, same, same, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    assert len(packings) > ring._agreed.capacity and len(ring._agreed) == ring._agreed.capacity
    ring(same, same, same, cu_seqlens=torch.tensor(packings[0], dtype=torch.int32))  # dropped: checked again
    # ranks out of step: each has agreed on both layouts (and shapes) before, then they get different
    # ones in the same call: every module raises on every rank, whatever each has seen before
    two = [torch.tensor(c, dtype=torch.int32) for c in ([0, 3, n], [0, 5, n])]
    same = torch.randn(1, 8, world, 8, generator=torch.Generator().manual_seed(0))  # heads: Ulysses splits them
    longer = torch.randn(1, 16, world, 8, generator=torch.Generator().manual_seed(0))
    modules = [dilated.RingAttention(backend="manual"), dilated.RingAttention(layout="zigzag", backend="manual"),
               dilated.UlyssesAttention(backend="manual"), dilated.HybridAttention(1, world, backend="manual"),
               dilated.DocumentParallelAttention(backend="manual")]
    for module in modules:
        for cu in two:
            module(same, same, same, cu_seqlens=cu)
        for inputs in ([same] * 3, [longer] * 3):
            module(*inputs)
        for what, call in (("cu_seqlens", lambda: module(same, same, same, cu_seqlens=two[rank % 2])),
                           ("q", lambda: module(*([same] * 3 if rank % 2 else [longer] * 3)))):
            try:
                call()
            except dilated.RankMismatchError as e:
                assert what in str(e) or "documents" in str(e), (type(module).__name__, what, e)
            else:
                raise AssertionError(f"rank {rank}: {type(module).__name__} ran with ranks out of step on {what}")
    # unshard of shards that differ: a ValueError naming each rank's shard, on every rank (no abort)
    for odd_shard in (torch.randn(1, 5 if rank % 2 else 4, 2, 8), torch.randn(1, 4, 2, 8, dtype=torch.float64 if rank % 2
                                                                             else torch.float32)):
        try:
            dilated.unshard(odd_shard)
        except ValueError as e:
            assert "the ranks' shards differ" in str(e) and "rank 1" in str(e), e
        else:
            raise AssertionError(f"rank {rank}: unshard gathered shards of different shapes or dtypes")
    assert dilated.unshard(torch.full((1, 2, 1, 1), float(rank))).flatten().tolist() == [
        float(r) for r in range(world) for _ in range(2)]
    assert time.time() - t0 < 30
    dist.destroy_process_group()


def random_strategies(rank, world, port, seed, count):
    """Seeded random configurations of every sequence-parallel strategy (ring, zigzag ring,
    Ulysses, the hybrid on each grid, distributed dilated), with packed documents where they take
    them, sharded by the module's own ``shard`` and gathered by its ``unshard``: output and
    gradients against the float64 single-process reference."""
    import random

    from dilated.reference import dilated_reference

    init(rank, world, port)
    rng = random.Random(seed)
    grids = [u for u in range(1, world + 1) if world % u == 0]
    for it in range(count):
        kind = rng.choice(["ring", "zigzag", "ulysses", "hybrid", "dilated", "ring_documents", "hybrid_documents"])
        causal = rng.random() < 0.5
        unit = 2 * world if kind in ("zigzag", "hybrid") else world
        n = unit * rng.randint(1, 8)
        hkv = rng.choice([1, 2, world])
        h = hkv * rng.choice([1, 2]) if kind not in ("ulysses", "hybrid", "hybrid_documents") else world * hkv
        backend = rng.choice(["manual", "sdpa", "sdpa_math"])
        g = torch.Generator().manual_seed(seed * 1000 + it)
        b = rng.choice([1, 2])
        q, k, v, dout = (torch.randn(b, n, hh, 8, dtype=torch.float64, generator=g) for hh in (h, hkv, hkv, h))
        cu = None
        if kind != "dilated" and n > 2 and rng.random() < 0.6:
            cu = [0, *sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 5)))), n]
        if kind == "ring":
            mod = dilated.RingAttention(causal=causal, backend=backend, layout="contiguous")
        elif kind == "zigzag":
            mod = dilated.RingAttention(causal=causal, backend=backend, layout="zigzag")
        elif kind == "ulysses":
            mod = dilated.UlyssesAttention(causal=causal, backend=backend)
        elif kind in ("hybrid", "hybrid_documents"):
            u = rng.choice(grids)
            mod = dilated.HybridAttention(u, world // u, causal=causal, backend=backend,
                                          layout="documents" if kind == "hybrid_documents" else "zigzag")
        elif kind == "ring_documents":
            mod = dilated.RingAttention(causal=causal, backend=backend, layout="documents")
        else:
            segs = sorted(rng.choice([2, 4, 6, 8, 16, 24, 32]) for _ in range(rng.randint(1, 3)))
            dils = [1] + [min(rng.choice([1, 2, 4]), w) for w in segs[1:]]
            mod = dilated.DistributedDilatedAttention(segs, dils, causal=causal, backend=backend)
        shard = mod.shard
        if kind.endswith("_documents"):  # shards in the DocumentLayout of the documents (one without cu)
            layout = mod.document_layout(cu or [0, n])
            shard = functools.partial(mod.shard, layout=layout)
        mine = [shard(x).clone().requires_grad_() for x in (q, k, v)]
        kw = {} if cu is None else {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
        out = mod(*mine, **kw)
        grads = torch.autograd.grad(out, mine, shard(dout))
        ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
        if kind == "dilated":
            ref = dilated_reference(*ref_in, segs, dils, causal=causal)
        elif cu is None:
            ref = dense_reference(*ref_in, causal=causal)[0]
        else:
            doc = torch.zeros(n, dtype=torch.long)
            for i in range(len(cu) - 1):
                doc[cu[i]:cu[i + 1]] = i
            seen = doc[:, None] == doc[None, :]
            if causal:
                seen &= torch.ones(n, n, dtype=torch.bool).tril()
            ref = dense_reference(*ref_in, bias=torch.where(seen, 0.0, float("-inf")).unsqueeze(0))[0]
        what = f"{mod!r} n={n} h={h}/{hkv} causal={causal} backend={backend} cu={cu}"
        _check(f"out of {what}", mod.unshard(out.detach()), ref, tol=1e-9)
        for name, gl, rg in zip("qkv", grads, torch.autograd.grad(ref, ref_in, dout)):
            _check(f"d{name} of {what}", mod.unshard(gl), rg, tol=1e-9)
    dist.destroy_process_group()


def steady_calls_do_not_sync(rank, world, port):
    """On GPUs (NCCL): every sequence-parallel module's third call, forward and backward, makes the
    host wait for the GPU nowhere (``torch.cuda.set_sync_debug_mode("error")``), with and without
    packed documents (``cu_seqlens`` a host tensor). A group of ranks 0 and 1 made first leaves the
    ranks with different numbers of groups: the world's host group must still be made without a
    wait (a group made by its own ranks only would be named after those numbers, and hang)."""
    faulthandler.dump_traceback_later(240, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=120))
    dist.new_group([0, 1])
    n, h = 1024 * world, 4 * world
    cu = torch.tensor([0, 100, 700, n // 2 + 3, n], dtype=torch.int32)
    modules = [(f"ring {layout} {transport} causal={causal}",
                dilated.RingAttention(causal=causal, layout=layout, transport=transport), True)
               for layout in ("contiguous", "zigzag") for transport in ("copy_engine", "p2p") for causal in (False, True)]
    modules += [(f"ulysses causal={causal}", dilated.UlyssesAttention(causal=causal), True) for causal in (False, True)]
    modules += [("ulysses document groups", dilated.UlyssesAttention(causal=True, document_groups="always"), True)]
    grids = [u for u in sorted({1, 2, world}) if world % u == 0]  # 2 x 2 on 4 GPUs: both groups NCCL subgroups
    modules += [(f"hybrid {u}x{world // u}", dilated.HybridAttention(u, world // u, causal=True), True)
                for u in grids]
    modules += [("distributed dilated", dilated.DistributedDilatedAttention([512, 1024, 2048], [1, 2, 4]), False)]
    modules += [(f"documents causal={causal}", dilated.DocumentParallelAttention(causal=causal), True)
                for causal in (False, True)]

    modules += [(f"ring documents causal={causal}", dilated.RingAttention(causal=causal, layout="documents"), True)
                for causal in (False, True)]
    modules += [(f"hybrid documents {u}x{world // u}",
                 dilated.HybridAttention(u, world // u, causal=True, layout="documents"), True) for u in grids]
    modules += [("hybrid documents row groups", dilated.HybridAttention(
        world // 2, 2, causal=True, layout="documents", document_groups="always"), True)] if world % 2 == 0 else []

    # a mix whose rows on a 2 x 2 grid keep documents within their ranks' parts (row_plans), the rest
    # exchanged at once or by documents
    rows_cu = torch.tensor([0, 166, 1061, 1578, 1659, 1723, 1991, 2095, 3105, 3459, 3647, 3762, 3955, 4096],
                           dtype=torch.int32)
    modules = [(*m, cu) for m in modules]
    modules += [(f"hybrid documents, local rows, document_groups={groups}", dilated.HybridAttention(
        2, 2, causal=True, layout="documents", local_documents="always", document_groups=groups), True, rows_cu)
        for groups in (1, "always")] if world == 4 else []

    def shard_of(module, docs):  # shards of document-laid-out modules follow the documents' layout
        if hasattr(module, "document_layout") and getattr(module, "layout", "documents") == "documents":
            layout = module.document_layout(docs if docs is not None else [0, n])
            return lambda t: module.shard(t, layout)
        return module.shard
    g = torch.Generator(device=dev).manual_seed(5)
    full = [torch.randn(1, n, hh, 64, device=dev, dtype=torch.bfloat16, generator=g) for hh in (h, h // 2, h // 2)]
    dout = torch.randn(full[0].shape, device=dev, dtype=torch.bfloat16, generator=g)
    for name, module, takes_documents, mix in modules:
        for docs in ((None, mix) if takes_documents else (None,)):
            kw = {} if docs is None else {"cu_seqlens": docs}
            shard = shard_of(module, docs)
            q, k, v = (shard(t).requires_grad_() for t in full)
            dl = shard(dout)
            for call in range(3):
                if call == 2:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    module(q, k, v, **kw).backward(dl)
                except RuntimeError as e:
                    raise AssertionError(f"{name}{' documents' if kw else ''}: call {call + 1}: {e}") from e
                finally:
                    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def _documents_reference(q, k, v, cu, causal):
    """float64 attention within each document of ``cu``, one document at a time (a loop, not a mask)."""
    outs = [dense_reference(q[:, a:b], k[:, a:b], v[:, a:b], causal=causal)[0] for a, b in zip(cu, cu[1:])]
    return torch.cat(outs, 1)


def document_parallel(rank, world, port):
    """DocumentParallelAttention and RingAttention(layout="documents") on mixes that take each path
    of their layout (documents whole on a rank, cut head-tail over every rank, cut at a rank's
    remaining room; one document; none crossing), causal and not, GQA and not, batch 2: output and
    gradients against float64 attention computed one document at a time."""
    from dilated.parallel.document_attention import rank_plan

    init(rank, world, port)
    n = 96 * world
    mixes = {
        "one document": [0, n],
        "whole and cut": [0, n // 2 + 5, n // 2 + 9, 3 * n // 4, n],
        "many small": list(range(0, n, 24)) + [n],
        "room": list(range(0, n, 15)) + [n],  # too short to cut head-tail: the last fits nowhere whole
    }
    paths = set()
    for name, cu in mixes.items():
        for causal in (True, False):
            for h, hkv in ((4, 2), (2, 2)):
                layout = dilated.DocumentLayout.balance(cu, world, causal, min_piece=4)
                crossing = layout.crossing()
                for r in range(world):
                    for x in layout.pieces[r]:
                        if x.doc not in crossing:
                            paths.add("whole")
                        elif len([y for m in layout.pieces for y in m if y.doc == x.doc]) == 2 * world:
                            paths.add("head-tail")
                        else:
                            paths.add("cut at room")
                g = torch.Generator().manual_seed(11 + len(cu))
                q, k, v, dout = (torch.randn(2, n, hh, 8, dtype=torch.float64, generator=g) for hh in (h, hkv, hkv, h))
                ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
                ref = _documents_reference(*ref_in, cu, causal)
                ref_grads = torch.autograd.grad(ref, ref_in, dout)
                # and on the layout that cuts every document of 2P positions or more head-tail
                head_tail = dilated.DocumentLayout.head_tail(cu, world, causal)
                for given, mod in itertools.product(
                        (layout, head_tail), (dilated.DocumentParallelAttention(causal=causal, backend="manual"),
                                              dilated.RingAttention(causal=causal, backend="manual", layout="documents"))):
                    steps = mod.stats.steps
                    mine = [mod.shard(x, given).clone().requires_grad_() for x in (q, k, v)]
                    out = mod(*mine, layout=given)
                    grads = torch.autograd.grad(out, mine, mod.shard(dout, given))
                    what = f"{type(mod).__name__} {name} causal={causal} h={h}/{hkv} head_tail={given is head_tail}"
                    _check(f"out of {what}", mod.unshard(out.detach()), ref, tol=1e-9)
                    for t, gl, rg in zip("qkv", grads, ref_grads):
                        _check(f"d{t} of {what}", mod.unshard(gl), rg, tol=1e-9)
                    if isinstance(mod, dilated.RingAttention):  # P - 1 hops each way, none without crossing rows
                        assert mod.stats.steps - steps == (2 * (world - 1) if given.crossing() else 0), what
                # only crossing documents' rows travel: none where no document crosses
                assert (rank_plan(layout, rank).rows == 0) == (not crossing), what
    assert paths == {"whole", "head-tail", "cut at room"}, paths
    # the same through cu_seqlens (the module's own layout), float32, sdpa
    cu = mixes["whole and cut"]
    mod = dilated.DocumentParallelAttention(causal=True, backend="sdpa")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, n, 2, 16, generator=g) for _ in range(3))
    layout = mod.document_layout(torch.tensor(cu, dtype=torch.int32))
    out = mod(*(mod.shard(x, layout) for x in (q, k, v)), cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    _check("float32 sdpa", mod.unshard(out), _documents_reference(q.double(), k.double(), v.double(), cu,
                                                                   True).float(), tol=2e-5)
    # documents that do not cover the global sequence, a layout for another world: the same error on every rank
    for bad, match in (({"cu_seqlens": [0, 8, n + world]}, "must end at the global length N"),
                       ({"layout": dilated.DocumentLayout.balance([0, n], world + 1 if n % (world + 1) == 0 else 1)},
                        "balanced for")):
        try:
            mod(*(mod.shard(x, layout) for x in (q, k, v)), **bad)
        except ValueError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"rank {rank}: ran with {bad}")
    dist.destroy_process_group()


def strategy_calls(rank, world, port):
    """The calibration's timed strategy calls on gloo: every strategy that runs on ``world`` ranks, both
    modes, the slowest rank's time on every rank; the hybrid (4 ranks or more) left out, saying why."""
    init(rank, world, port)
    from dilated.bench.planner import measure

    measure.STRATEGY_ROWS = 256
    said = []
    points = measure.measure_strategies((4, 2, 16), torch.device("cpu"), "auto", reps=2, log=said.append)
    want = {(s, m) for s in ("documents", "ring_documents", "ring_zigzag", "ulysses") for m in ("fwd", "fwd_bwd")}
    assert {(x.strategy, x.mode) for x in points} == want
    assert all(x.ms > 0 and x.ranks == world and x.seq_len == world * 256 for x in points)
    assert [x.documents is not None for x in points] == [x.strategy.endswith("documents") for x in points]
    slowest = torch.tensor([x.ms for x in points])
    every = [torch.empty_like(slowest) for _ in range(world)]
    dist.all_gather(every, slowest)
    assert all(torch.equal(e, slowest) for e in every)
    assert any(line.startswith("strategy hybrid") and "left out" in line for line in said)
    dist.destroy_process_group()


def host_groups_never_wait_on_group_counts(rank, world, port):
    """:func:`dilated.parallel.agreement.host_group` on real gloo groups, its backend names read as
    NCCL's (the NCCL case needs GPUs; the choice does not): the world's host group is made by every
    rank of the world, without a group-local rendezvous (whose group names count each rank's groups
    and differ where the ranks made different groups before), even after a group of ranks 0 and 1;
    that subgroup gets none (the check goes to the GPU, said once); a group with a gloo backend
    beside NCCL's serves itself. A rank still waiting after 60 s prints its stack and exits."""
    from dilated.parallel import agreement

    faulthandler.dump_traceback_later(60, exit=True)
    init(rank, world, port)
    made = []
    real_new_group, real_get_backend = dist.new_group, dist.get_backend

    def new_group(*args, **kwargs):
        made.append(kwargs)
        return real_new_group(*args, **kwargs)

    sub = real_new_group([0, 1])  # ranks 0 and 1 now hold one group more than the others
    backend_name = {"name": "nccl"}
    dist.new_group = new_group
    dist.get_backend = lambda group=None: backend_name["name"]
    try:
        host = agreement.host_group(None)
        assert host is not None and host is not dist.group.WORLD
        assert made == [{"backend": "gloo"}], made  # made by every rank, not group-locally
        t = torch.tensor([rank])
        real_all_reduce = dist.all_reduce
        real_all_reduce(t, group=host)
        assert int(t) == sum(range(world))
        assert agreement.host_group(None) is host and len(made) == 1  # made once
        if rank < 2:
            assert agreement.host_group(sub) is None and len(made) == 1
            backend_name["name"] = "cpu:gloo,cuda:nccl"
            assert agreement.host_group(sub) is sub and len(made) == 1
        backend_name["name"] = "cpu:gloo,cuda:nccl"  # a world with a host backend serves itself
        assert agreement.host_group(None) is dist.group.WORLD and len(made) == 1
    finally:
        dist.new_group, dist.get_backend = real_new_group, real_get_backend
    # the gloo world itself: its modules' agreement checks stay on the host, said by no warning
    assert agreement.host_group(None) is dist.group.WORLD
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = torch.randn(1, 16, 2, 8, generator=torch.Generator().manual_seed(rank))
        dilated.RingAttention(causal=True)(q, q, q)
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
