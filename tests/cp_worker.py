"""Workers for tests/parallel/test_context_parallel.py: Ulysses and the Ulysses x ring hybrid on real gloo
process groups, against a float64 dense reference of the whole sequence."""
import math
import os
import random
import sys

import torch
import torch.distributed as dist

import dilated
from dilated.reference import dense_reference

from dist_worker import init


def worker(fn):
    """A test body run on every rank of a fresh gloo group; ranks leave together (barrier,
    destroy), so none exits while a peer still talks to it. A rank whose body passed leaves
    without the interpreter's teardown (``os._exit(0)``): with the varlen stand-ins registered as
    custom ops in the process, that teardown aborted ("terminate called without an active
    exception") in about 1 of 8 runs, after both ranks had finished and left the group."""
    def run(rank, world, port, *args):
        init(rank, world, port)
        fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    run.__name__, run.__qualname__ = fn.__name__, fn.__qualname__  # picklable by name for mp.spawn
    return run


def _full(seed, n, h, hkv, d=8, b=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, hh, d, generator=g, dtype=torch.float64) for hh in (h, hkv, hkv)]


def _rel(got, ref):
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def check_module(module, q, k, v, causal, name, tol=1e-9):
    """``module`` on this rank's shards (its own ``shard``) against the dense reference of the
    whole sequence, forward and gradients (gathered with its own ``unshard``)."""
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(99), dtype=q.dtype)  # same on every rank
    ql, kl, vl = (module.shard(t).requires_grad_() for t in (q, k, v))
    out = module(ql, kl, vl)
    out.backward(module.shard(dout))
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = dense_reference(qf, kf, vf, causal=causal)[0]
    ref.backward(dout)
    errs = {"out": _rel(module.unshard(out.detach()), ref.detach())}
    for t, (local, full) in zip("qkv", ((ql, qf), (kl, kf), (vl, vf))):
        errs[f"d{t}"] = _rel(module.unshard(local.grad), full.grad)
    bad = {k_: e for k_, e in errs.items() if not e < tol}
    assert not bad, f"{name}: {bad}"


@worker
def ulysses(rank, world):
    h = 12  # divisible by 2, 3 and 4
    for causal in (False, True):
        for hkv in (12, 4, 2, 1):  # split (12, 4 on 2 and 4), replicated (4 on 3; 2 and 1 mostly)
            kv_local = max(hkv, math.lcm(hkv, world)) // world
            most = max(g for g in (1, 2, 3, 4) if (h // world) % g == 0 and (kv_local % g == 0 or g % kv_local == 0))
            # "auto": one group here (the manual kernel has no varlen call); the most groups up to 4
            for head_groups, groups in (("auto", 1), (most, most)):
                q, k, v = _full(7 + hkv, 6 * world, h, hkv)
                module = dilated.UlyssesAttention(causal=causal, backend="manual", head_groups=head_groups)
                check_module(module, q, k, v, causal,
                             f"ulysses P={world} causal={causal} H={h}/{hkv} head_groups={head_groups}")
                module.stats.reset()
                shards = [module.shard(t).requires_grad_() for t in (q, k, v)]
                out = module(*shards)
                # per group one exchange in (its q, with its kv group's k and v where it reads them first)
                # and one back; every byte of q, k and v sent once (all but this rank's own block)
                sizes = [t.numel() * t.element_size() for t in shards]
                moved = (world - 1) / world * (sizes[0] + (sizes[1] + sizes[2]) * kv_local * world // hkv)
                assert module.stats.collectives == 2 * groups and module.stats.bytes_sent == moved + (
                    (world - 1) / world * out.numel() * out.element_size()), (groups, module.stats.as_dict())
                module.stats.reset()
                out.backward(torch.ones_like(out))
                # per group its output gradient in, and its dq (with its kv group's dk and dv after their
                # last reader) back
                assert module.stats.collectives == 2 * groups, (groups, module.stats.as_dict())
    # ranks asking for other head groups: an error on every rank (their all-to-alls would not pair up)
    q, k, v = _full(2, 4 * world, 4 * world, 4 * world)
    module = dilated.UlyssesAttention(backend="manual", head_groups=1 if rank == 0 else 2)
    try:
        module(*(module.shard(t) for t in (q, k, v)))
    except dilated.RankMismatchError as e:
        assert "head_groups" in str(e), str(e)
    else:
        raise AssertionError("ranks with other head groups ran")
    # head groups that do not divide a rank's heads: a clear error naming the argument
    q, k, v = _full(1, 4 * world, 12, 12)
    try:
        dilated.UlyssesAttention(backend="manual", head_groups=5)(*(dilated.UlyssesAttention().shard(t)
                                                                     for t in (q, k, v)))
    except ValueError as e:
        assert "head_groups must be a positive integer dividing the" in str(e), str(e)
    else:
        raise AssertionError("5 head groups of 12/P heads ran")
    # heads not divisible by the ranks: a clear error on every rank, naming the fix
    q, k, v = _full(1, 4 * world, 5 if world != 5 else 7, 1)
    module = dilated.UlyssesAttention(backend="manual")
    try:
        module(*(module.shard(t) for t in (q, k, v)))
    except ValueError as e:
        assert "num_heads 5 must be divisible by" in str(e) and "RingAttention" in str(e), str(e)
    else:
        raise AssertionError("heads not divisible by the world size ran")


@worker
def hybrid(rank, world, grids):
    h = 12  # divisible by every ulysses_size below
    for ulysses_size, ring_size in grids:
        for layout in ("zigzag", "contiguous"):
            for causal in (False, True):
                for hkv in (12, 3, 1):
                    q, k, v = _full(3 + hkv, 4 * world, h, hkv)
                    # zigzag: a row's heads in as many groups as they allow (up to 3), the ring on each
                    kv_local = max(hkv, math.lcm(hkv, ulysses_size)) // ulysses_size
                    groups = "auto" if layout == "contiguous" else max(
                        g for g in (1, 2, 3)
                        if (h // ulysses_size) % g == 0 and (kv_local % g == 0 or g % kv_local == 0))
                    module = dilated.HybridAttention(ulysses_size, ring_size, causal=causal, layout=layout,
                                                     backend="manual", head_groups=groups)
                    check_module(module, q, k, v, causal, f"hybrid {ring_size}x{ulysses_size} {layout} "
                                 f"causal={causal} H={h}/{hkv} head_groups={groups}")
    try:
        dilated.HybridAttention(world, 2)
    except ValueError as e:
        assert f"must equal the group's size {world}" in str(e), str(e)
    else:
        raise AssertionError("a grid larger than the world was accepted")


@worker
def shard_methods(rank, world):
    """Every sequence-parallel module maps a global tensor to this rank's part in its own layout and
    back; the ring's part is the free function's for its layout; a wrong part is caught by an exact
    forward (ring zigzag causal, distributed dilated)."""
    x = torch.randn(2, 8 * world, 4, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    modules = [dilated.RingAttention(layout="zigzag", backend="manual"), dilated.RingAttention(backend="manual"),
               dilated.UlyssesAttention(backend="manual"),
               dilated.DistributedDilatedAttention([4, 8 * world], [1, 2], backend="manual")]
    for m in modules:
        assert torch.equal(m.unshard(m.shard(x)), x), type(m).__name__
        assert m.shard(x).shape[1] == 8
    assert torch.equal(modules[0].shard(x), dilated.shard(x, layout="zigzag"))
    q, k, v = _full(11, 8 * world, 4, 2)
    check_module(dilated.RingAttention(layout="zigzag", causal=True, backend="manual"), q, k, v, True, "ring zigzag")


@worker
def ulysses_documents(rank, world):
    n = 12 * world
    cu = [0, 5, 6, 17, n - 3, n]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    for causal in (False, True):
        q, k, v = _full(21, n, 4 * world, 2)
        module = dilated.UlyssesAttention(causal=causal, backend="manual")
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=q.dtype)
        ql, kl, vl = (module.shard(t).requires_grad_() for t in (q, k, v))
        out = module(ql, kl, vl, cu_seqlens=cu_t)
        out.backward(module.shard(dout))
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        ref = torch.cat([dense_reference(qf[:, a:b], kf[:, a:b], vf[:, a:b], causal=causal)[0]
                         for a, b in zip(cu, cu[1:])], 1)
        ref.backward(dout)
        assert _rel(module.unshard(out.detach()), ref.detach()) < 1e-9
        for local, full in ((ql, qf), (kl, kf), (vl, vf)):
            assert _rel(module.unshard(local.grad), full.grad) < 1e-9
    # documents that disagree across ranks: an error on every rank, before any all-to-all
    mine = torch.tensor([0, 5 + rank, n], dtype=torch.int32)
    try:
        module(*(module.shard(t) for t in (q, k, v)), cu_seqlens=mine)
    except (ValueError, dilated.RankMismatchError) as e:
        assert "documents" in str(e), str(e)
    else:
        raise AssertionError("ranks with different documents ran")


def _per_document(q, k, v, cu, causal):
    return torch.cat([dense_reference(q[:, a:b], k[:, a:b], v[:, a:b], causal=causal)[0]
                      for a, b in zip(cu, cu[1:])], 1)


def _matches_per_document(module, inputs, grads_of, out, dout, cu, causal, name):
    """``out`` and the local inputs' gradients (gathered by the module's ``unshard``) against each
    document of the full ``inputs`` run alone, in float64."""
    full = [t.clone().requires_grad_() for t in inputs]
    ref = _per_document(*full, cu, causal)
    ref.backward(dout)
    assert _rel(module.unshard(out.detach()), ref.detach()) < 1e-9, name
    for t, local, whole in zip("qkv", grads_of, full):
        assert _rel(module.unshard(local.grad), whole.grad) < 1e-9, f"{name} d{t}"


@worker
def ring_documents(rank, world, varlen=None):
    """Ring (contiguous and zigzag) and the hybrid with packed documents that cross shard and
    chunk boundaries, forward and gradients, against each document run alone. ``varlen="torch"``:
    with ``backend="auto"`` served by a stand-in of torch's varlen ops (tests/varlen_standins.py),
    which must then run the documents of every chunk with itself; ``varlen="small"``: ``auto``
    without a varlen entry point, every batched call counted small, so the documents go to that
    stand-in as the small ones (:data:`dilated.packed.SMALL_CALL_FLOPS`)."""
    backend = "manual"
    if varlen == "small":
        import sys

        import varlen_standins
        from dilated import packed
        from dilated.backends import varlen as varlen_module

        ring_module = sys.modules["dilated.parallel.ring_attention"]
        varlen_module.torch_varlen_ops = lambda: varlen_standins.TORCH_OPS["new"]
        ring_module.small_documents_kernel = lambda q, k, v, causal=False: varlen_module.TorchVarlen()
        packed.SMALL_CALL_FLOPS = float("inf")
        backend = "auto"
    elif varlen is not None:
        import varlen_standins

        varlen_standins.install(None, varlen)
        backend = "auto"
    n = 8 * world
    # documents inside a chunk, and across chunk and shard boundaries with several positions on each side
    cu = sorted({0, 1, 3, n // 2 - 3, n // 2 + 3, n - 2, n})
    modules = [lambda c: dilated.RingAttention(causal=c, layout="contiguous", backend=backend),
               lambda c: dilated.RingAttention(causal=c, layout="zigzag", backend=backend)]
    if world == 4:
        modules.append(lambda c: dilated.HybridAttention(2, 2, causal=c, backend=backend))
    for make in modules:
        for causal in (False, True):
            module = make(causal)
            q, k, v = _full(5, n, 4, 2)
            dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8), dtype=q.dtype)
            ql, kl, vl = (module.shard(t).requires_grad_() for t in (q, k, v))
            out = module(ql, kl, vl, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
            out.backward(module.shard(dout))
            name = f"{type(module).__name__} {getattr(module, 'layout', '')} causal={causal}"
            _matches_per_document(module, (q, k, v), (ql, kl, vl), out, dout, cu, causal, name)
    if varlen is not None:  # every ring call ran its chunks' own documents in the varlen kernel
        calls = varlen_standins.CALLS
        assert calls["torch_forward"] >= 2 * len(modules) and calls["torch_backward"] >= 2 * len(modules), calls


@worker
def dilated_any_schedule(rank, world):
    """DistributedDilatedAttention on schedules whose segments do not line up with the shards
    (neither divides the other, a clipped last segment across shards) and on a world of 3,
    against the single-process dilated reference, forward and gradients."""
    from dilated.reference import dilated_reference

    n_local = 24
    n = n_local * world
    # (shards start mid-segment at positions that are not multiples of r: w=14, r=4)
    schedules = [([16, 48], [1, 2]), ([10, 14, 36, n], [1, 4, 3, 4]), ([2 * n_local, n], [2, 4]), ([7], [1])]
    for segs, dils in schedules:
        for causal in (False, True):
            for h, hkv in ((4, 4), (4, 2)):
                q, k, v = _full(13, n, h, hkv)
                module = dilated.DistributedDilatedAttention(segs, dils, causal=causal, backend="manual")
                dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=q.dtype)
                ql, kl, vl = (module.shard(t).requires_grad_() for t in (q, k, v))
                out = module(ql, kl, vl)
                out.backward(module.shard(dout))
                qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
                ref = dilated_reference(qf, kf, vf, segs, dils, causal)
                ref.backward(dout)
                name = f"P={world} w={segs} r={dils} causal={causal} H={h}/{hkv}"
                assert _rel(module.unshard(out.detach()), ref.detach()) < 1e-9, name
                for t, (local, full) in zip("qkv", ((ql, qf), (kl, kf), (vl, vf))):
                    assert _rel(module.unshard(local.grad), full.grad) < 1e-9, f"{name} d{t}"
    # one module at many lengths (an inference server's): what it keeps per length stays bounded
    module = dilated.DistributedDilatedAttention([16, 48], [1, 2], backend="manual")
    kept = module._layouts.max_entries
    for n_local in range(8, 8 + kept + 4):
        q, k, v = _full(3, n_local * world, 2, 2)
        out = module(*(module.shard(t) for t in (q, k, v)))
        assert _rel(module.unshard(out), dilated_reference(q, k, v, [16, 48], [1, 2])) < 1e-9, n_local
    assert module._layouts.stats()["size"] == kept


def _random_case(rng, world):
    """One seeded configuration of a sequence-parallel module for ``world`` ranks: the module and
    its layout or grid, heads (GQA split or replicated), length, causal, packed documents (one,
    random cuts, or documents of one position) or a dilated schedule that the shards do not line up
    with, and dtype (float64 on ``manual``; float32 on ``manual``, ``sdpa`` or ``auto``)."""
    c = {"kind": rng.choice(["ring", "ulysses", "hybrid", "dilated"]), "causal": rng.random() < 0.5,
         "d": rng.choice([8, 16, 24]), "b": rng.randint(1, 2), "docs": None, "layout": None, "grid": None}
    c["dtype"] = rng.choice([torch.float64, torch.float64, torch.float32])
    c["backend"] = "manual" if c["dtype"] == torch.float64 else rng.choice(["manual", "sdpa", "auto"])
    ring_ranks, heads_unit = world, 1
    if c["kind"] in ("ring", "hybrid"):
        c["layout"] = rng.choice(["contiguous", "zigzag"])
    if c["kind"] == "hybrid":
        c["grid"] = rng.choice([(u, world // u) for u in range(1, world + 1) if world % u == 0])
        heads_unit, ring_ranks = c["grid"]
    elif c["kind"] == "ulysses":
        heads_unit = world
    c["h"] = heads_unit * rng.randint(1, 3) if c["kind"] != "ring" else rng.randint(1, 6)
    c["hkv"] = rng.choice([x for x in range(1, c["h"] + 1) if c["h"] % x == 0])
    chunks = ring_ranks * (2 if c["layout"] == "zigzag" else 1)
    c["n"] = (world // ring_ranks) * chunks * rng.randint(1, 10)
    if c["kind"] == "dilated":
        segs = sorted(rng.sample(range(1, c["n"] + 1), min(c["n"], rng.randint(1, 3))))
        dils = [rng.randint(1, min(4, w)) for w in segs]
        dils[0] = 1  # every row covered
        c["schedule"] = (segs, dils)
    elif rng.random() < 0.6:
        n = c["n"]
        cuts = {"one": [], "ones": range(1, n), "random": rng.sample(range(1, n), min(n - 1, rng.randint(1, 8)))}
        c["docs"] = sorted({0, n, *cuts[rng.choice(list(cuts))]})
    return c


def _random_module(c):
    if c["kind"] == "ring":
        return dilated.RingAttention(causal=c["causal"], layout=c["layout"], backend=c["backend"])
    if c["kind"] == "ulysses":
        return dilated.UlyssesAttention(causal=c["causal"], backend=c["backend"])
    if c["kind"] == "hybrid":
        return dilated.HybridAttention(*c["grid"], causal=c["causal"], layout=c["layout"], backend=c["backend"])
    return dilated.DistributedDilatedAttention(*c["schedule"], causal=c["causal"], backend=c["backend"])


@worker
def random_configurations(rank, world, seeds):
    """Seeded random configurations (:func:`_random_case`) on this group, each against the float64
    reference of the whole problem: the dense one, each document alone, or the dilated one;
    forward and gradients. Errors are relative to the reference's largest entry, or to a floor where
    that is smaller (documents of one position have gradients of q and k that are exactly zero):
    1e-3 in float64, 0.05 in float32, whose rounding on gradients near zero is some 1e-7."""
    from dilated.reference import dilated_reference

    for seed in seeds:
        rng, gen = random.Random(1000 * world + seed), torch.Generator().manual_seed(seed)
        c = _random_case(rng, world)
        q, k, v = (torch.randn(c["b"], c["n"], hh, c["d"], generator=gen, dtype=torch.float64)
                   for hh in (c["h"], c["hkv"], c["hkv"]))
        dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
        module = _random_module(c)
        ql, kl, vl = (module.shard(t.to(c["dtype"])).requires_grad_() for t in (q, k, v))
        docs = {} if c["docs"] is None else {"cu_seqlens": torch.tensor(c["docs"], dtype=torch.int32)}
        out = module(ql, kl, vl, **docs)
        out.backward(module.shard(dout.to(c["dtype"])))
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        if c["kind"] == "dilated":
            ref = dilated_reference(qf, kf, vf, *c["schedule"], c["causal"])
        else:
            ref = _per_document(qf, kf, vf, c["docs"] or [0, c["n"]], c["causal"])
        ref.backward(dout)
        tol, floor = (1e-9, 1e-3) if c["dtype"] == torch.float64 else (2e-4, 0.05)
        pairs = {"out": (out.detach(), ref.detach()), **{f"d{t}": (lo.grad, fu.grad) for t, lo, fu in
                                                         zip("qkv", (ql, kl, vl), (qf, kf, vf))}}
        errs = {name: ((module.unshard(got).double() - want).abs().max() / want.abs().max().clamp_min(floor)).item()
                for name, (got, want) in pairs.items()}
        bad = {name: e for name, e in errs.items() if not e < tol}
        assert not bad, f"seed {seed} on {world} ranks: {c}: {bad}"


@worker
def documents_varlen(rank, world, kernel):
    """DocumentParallelAttention with a varlen entry point (stand-ins of torch's ops, ``kernel="torch"``,
    or of flash-attn 4's, ``"fa4"``): its local pieces and its crossing rectangles (q and kv of other
    lengths) each in one varlen call, forward and backward, against each document run alone."""
    import varlen_standins

    varlen_standins.install(None, kernel)
    backend = "auto" if kernel == "torch" else "flash_attn_4"
    n = 48 * world
    cu = [0, 5, n // 2 + 7, n // 2 + 9, n]  # a long document cut head-tail, short ones whole
    for causal in (True, False):
        module = dilated.DocumentParallelAttention(causal=causal, backend=backend)
        layout = dilated.DocumentLayout.balance(cu, world, causal, min_piece=2)
        assert layout.crossing(), "no crossing document: the rectangles would not run"
        (q, k, v), mine, out, dout, ran = _counting_varlen_calls(module, layout, n, 7)
        assert ran == (2, 2), ran  # local + rectangles, forward and backward
        _matches_per_document(module, (q, k, v), mine, out, dout, cu, causal, f"{kernel} causal={causal}")


def _counting_varlen_calls(module, layout, n: int, seed: int):
    """``module`` (on a document layout) forward and backward on fresh inputs of ``n`` rows sharded by
    ``layout``: ``(global q, k, v; the shards; out; dout; (forward, backward) calls of the varlen
    stand-ins it made)``."""
    import varlen_standins

    q, k, v = _full(seed, n, 4, 2)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=q.dtype)
    mine = tuple(module.shard(t, layout).requires_grad_() for t in (q, k, v))
    before = dict(varlen_standins.CALLS)
    out = module(*mine, layout=layout)
    out.backward(module.shard(dout, layout))
    ran = {key: varlen_standins.CALLS[key] - before.get(key, 0) for key in varlen_standins.CALLS}
    return (q, k, v), mine, out, dout, tuple(sum(c for key, c in ran.items() if key.endswith(end))
                                             for end in ("forward", "backward"))


@worker
def documents_small_rectangles(rank, world):
    """Without a varlen entry point, ``auto`` runs crossing rectangles too small for a call each in one
    call of torch's varlen kernel (a stand-in of its ops, tests/varlen_standins.py): on the layout that
    cuts every document head-tail, DocumentParallelAttention and RingAttention(layout="documents"),
    causal and not, exact against each document run alone; with every call counted small, the local
    pieces and the rectangles go to that kernel (two forward calls, two backward), with none counted
    small, neither does."""
    import varlen_standins
    from dilated import packed
    from dilated.backends import varlen as varlen_module
    from dilated.parallel import document_attention

    varlen_module.torch_varlen_ops = lambda: varlen_standins.TORCH_OPS["new"]
    document_attention.small_documents_kernel = lambda q, k, v, causal=False: varlen_module.TorchVarlen()
    n = 24 * world
    cu = [0, 4 * world, 12 * world, 18 * world, n]
    for small, calls in ((float("inf"), 2), (0.0, 0)):
        packed.SMALL_CALL_FLOPS = small
        for causal in (True, False):
            layout = dilated.DocumentLayout.head_tail(cu, world, causal)
            for module in (dilated.DocumentParallelAttention(causal=causal, backend="auto"),
                           dilated.RingAttention(causal=causal, backend="auto", layout="documents")):
                qkv, mine, out, dout, ran = _counting_varlen_calls(module, layout, n, 3)
                what = f"{type(module).__name__} small={small} causal={causal}"
                assert ran == (calls, calls), (what, ran)
                _matches_per_document(module, qkv, mine, out, dout, cu, causal, what)


@worker
def decode(rank, world, seed):
    """decode_attention over a cache split unevenly over the ranks (one rank holding no rows), GQA,
    one and several query tokens, against float64 softmax over the whole cache; one collective."""
    from dilated.parallel.sharding import CommStats

    g = torch.Generator().manual_seed(seed)  # the same draw on every rank
    for tq, h, hkv, split in ((1, 4, 2, None), (3, 6, 6, None), (2, 8, 2, 4)):
        rows = [0] + [4 * int(torch.randint(1, 10, (1,), generator=g)) for _ in range(world - 1)]
        rows = rows[-1:] + rows[:-1] if seed % 2 else rows  # the empty shard on rank 0 or on rank 1
        q = torch.randn(2, tq, h, 8, generator=g, dtype=torch.float64) * 3
        k, v = (torch.randn(2, sum(rows), hkv, 8, generator=g, dtype=torch.float64) for _ in range(2))
        start = sum(rows[:rank])
        stats = CommStats()
        with torch.no_grad():
            out = dilated.decode_attention(q, k[:, start:start + rows[rank]], v[:, start:start + rows[rank]],
                                           split=split, stats=stats)
        keys, values = (x.repeat_interleave(h // hkv, 2) for x in (k, v))
        p = torch.einsum("bqhd,bkhd->bhqk", q, keys).mul(8 ** -0.5).softmax(-1)
        ref = torch.einsum("bhqk,bkhd->bqhd", p, values)
        assert _rel(out, ref) < 1e-12, (rank, tq, rows, _rel(out, ref))
        assert stats.collectives == 1 and stats.messages == 0, vars(stats)


@worker
def ring_uneven_documents_warn(rank, world):
    """A zigzag ring on documents that leave its ranks uneven (short documents, then a long one)
    warns once, naming layout='documents'; one document (zigzag's own case) and the documents'
    layout do not warn."""
    import warnings

    n = 32 * world
    uneven = torch.tensor([0, *range(2, n // 2 + 1, 2), n], dtype=torch.int32)
    one = torch.tensor([0, n], dtype=torch.int32)
    q, k, v = _full(3, n, 2, 2)
    cases = ((dilated.RingAttention(causal=True, layout="zigzag", backend="manual"), [uneven, uneven], 1),
             (dilated.RingAttention(causal=True, layout="zigzag", backend="manual"), [one], 0),
             (dilated.RingAttention(causal=True, layout="documents", backend="manual"), [uneven], 0))
    for module, mixes, warned in cases:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for cu in mixes:
                layout = module.document_layout(cu) if module.layout == "documents" else None
                module(*(module.shard(t, layout) if layout else module.shard(t) for t in (q, k, v)), cu_seqlens=cu)
        said = [str(w.message) for w in seen if "packed documents" in str(w.message)]
        assert len(said) == warned, (module.layout, said)
        assert all("layout='documents'" in m for m in said), said


@worker
def ulysses_local_documents(rank, world):
    """Ulysses with documents that lie whole within one rank's shard attended there: exact against
    every document alone in float64, forward and gradients, GQA split or replicated, batch 2; documents
    of one length on the shards' boundaries move nothing; with a document across each boundary only
    those cross (one exchange of q, k, v and one of the output), the others stay; "auto" exchanges
    every document where keeping them would leave the ranks' work uneven."""
    n = 16 * world
    aligned = list(range(0, n * world + 1, 4))  # documents of 4 rows, shards of 16
    # one document across each boundary; the local ones between (3 + 2 + 3 + ... rows)
    crossing = [0, 3, 5, *[x for r in range(1, world) for x in (r * n - 3, r * n + 3, r * n + 5)], n * world]
    for causal, cu, setting, collectives in ((True, aligned, "auto", 0), (False, aligned, "always", 0),
                                             (True, crossing, "always", 2), (False, crossing, "always", 2)):
        for h, hkv in ((2 * world, world), (2 * world, 1)):
            q, k, v = _full(41 + hkv, n * world, h, hkv)
            module = dilated.UlyssesAttention(causal=causal, backend="manual", local_documents=setting)
            dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
            ql, kl, vl = (module.shard(t).requires_grad_() for t in (q, k, v))
            module.stats.reset()
            out = module(ql, kl, vl, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
            assert module.stats.collectives == collectives, (cu, module.stats.as_dict())
            out.backward(module.shard(dout))
            _matches_per_document(module, (q, k, v), (ql, kl, vl), out, dout, cu, causal,
                                  f"ulysses local documents P={world} causal={causal} H={h}/{hkv} {cu}")
    # uneven: one rank's shard holds a long document, the others short ones: "auto" exchanges the long one
    # (fewer bytes than every document), "always" none; and one long document in the middle of rank 0's
    # shard between short ones: its own documents are two runs of rows, gathered and put back
    # (any share of the rows exchanged: these small mixes need most of them moved to balance, which the
    # rule of MOST_EXCHANGED, tested on its own, would answer with every document exchanged)
    from dilated.parallel import local_documents as ld

    uneven = [0, n, *range(n + 2, n * world + 1, 2)]
    middle = [0, 2, 4, n - 4, n - 2, *range(n, n * world + 1)]
    ld.MOST_EXCHANGED, most = 1.0, ld.MOST_EXCHANGED
    # (an exchange carries q, k and v at once, and one brings the output back)
    for cu, setting, collectives in ((uneven, "auto", 2), (uneven, "always", 0), (uneven, False, 2),
                                     (middle, "auto", 2)):
        q, k, v = _full(9, n * world, world, world)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6), dtype=q.dtype)
        module = dilated.UlyssesAttention(causal=True, backend="manual", local_documents=setting,
                                          document_groups=1, head_groups=1)
        ql, kl, vl = (module.shard(t).requires_grad_() for t in (q, k, v))
        out = module(ql, kl, vl, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
        assert module.stats.collectives == collectives, (setting, module.stats.as_dict())
        sent = module.stats.bytes_sent
        if setting == "auto":
            assert 0 < sent < _sent_by_every_document(q, k, v, cu, world), sent
        out.backward(module.shard(dout))
        _matches_per_document(module, (q, k, v), (ql, kl, vl), out, dout, cu, True,
                              f"ulysses local documents P={world} {setting} {cu}")
    ld.MOST_EXCHANGED = most
    if world == 4:  # the hybrid on the documents' layout: where every document is whole in a rank's part
        _hybrid_local_documents(n)
    for bad in (True, 1, "sometimes"):
        try:
            dilated.UlyssesAttention(local_documents=bad)
        except ValueError as e:
            assert "local_documents must be" in str(e), str(e)
        else:
            raise AssertionError(f"local_documents={bad!r} was accepted")


@worker
def local_documents_beside_both_exchanges(rank, world):
    """A rank's own documents attend in two parts: the first after the exchanged documents' input
    exchange is issued, the second after their output's exchange is issued (backward: the first
    after the output gradient's exchange, the second after the q, k, v gradients' exchange back);
    exact against every document alone."""
    from dilated.parallel import document_groups as dg

    n = 16 * world
    crossing = [0, 3, 5, *[x for r in range(1, world) for x in (r * n - 3, r * n + 3, r * n + 5)], n * world]
    q, k, v = _full(17, n * world, 2 * world, world)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8), dtype=q.dtype)
    events, real = [], dg.AllToAll

    def exchange(x, *args):
        events.append("exchange")
        return real(x, *args)

    def attend(qg, kg, vg, cu_g):
        own = qg.shape[2] == q.shape[2]  # a rank's own documents attend on all its heads
        name = f"own {qg.shape[1]}" if own else "exchanged"
        events.append(name)
        out = dilated.attention(qg, kg, vg, causal=True, backend="manual",
                                cu_seqlens=torch.tensor(cu_g, dtype=torch.int32))
        if out.requires_grad:
            out.register_hook(lambda g: events.append(f"backward {name}"))
        return out

    module = dilated.UlyssesAttention(causal=True, backend="manual", local_documents="always")
    ql, kl, vl = (module.shard(t).requires_grad_() for t in (q, k, v))
    from dilated.parallel.local_documents import contiguous_ranges, local_documents
    from dilated.parallel.sharding import CommStats

    kept = local_documents("always", crossing, contiguous_ranges(n * world, world), True)
    parts = kept.parts(rank, "cpu")
    assert len(parts) == 2 and [x[1][-1] for x in parts] == [sum(m for _, m in s) for s in kept.part_spans(rank)]
    dg.AllToAll = exchange
    try:
        out = dg.attend_by_document_groups(ql, kl, vl, attend, cu=crossing, groups=[list(kept.exchanged)],
                                           group=None, stats=CommStats(), local=parts)
        forward, events[:] = list(events), []
        out.backward(module.shard(dout))
    finally:
        dg.AllToAll = real
    a, b = (f"own {x[1][-1]}" for x in parts)
    # one exchange carries the exchanged documents' q, k and v (backward: their dq, dk and dv)
    assert forward == ["exchange", a, "exchanged", "exchange", b], forward
    assert events == ["exchange", f"backward {a}", "backward exchanged", "exchange", f"backward {b}"], events
    _matches_per_document(module, (q, k, v), (ql, kl, vl), out, dout, crossing, True,
                          f"own documents beside both exchanges P={world}")


def _sent_by_every_document(q, k, v, cu, world):
    """Bytes a rank sends forward with every document exchanged."""
    module = dilated.UlyssesAttention(causal=True, backend="manual", local_documents=False, document_groups=1,
                                      head_groups=1)
    module(*(module.shard(t) for t in (q, k, v)), cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    return module.stats.bytes_sent


def _hybrid_local_documents(n):
    """HybridAttention(2, 2, layout="documents"): documents of one length, whole in each rank's part,
    attended there (nothing sent); a document across two ranks' parts makes every document go the
    usual way; exact against every document alone, forward and gradients."""
    whole = list(range(0, 4 * n + 1, 4))
    across = [0, n // 2 + 1, *range(n // 2 + 4, 4 * n + 1, 4)]
    for cu, setting, moves in ((whole, "auto", False), (whole, False, True), (across, "always", True)):
        for causal in (True, False):
            module = dilated.HybridAttention(2, 2, causal=causal, layout="documents", backend="manual",
                                             local_documents=setting)
            layout = module.document_layout(cu)
            q, k, v = _full(17, 4 * n, 4, 2)
            dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=q.dtype)
            ql, kl, vl = (module.shard(t, layout).requires_grad_() for t in (q, k, v))
            module.stats.reset()
            out = module(ql, kl, vl, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
            assert (module.stats.bytes_sent > 0) == moves, (cu, setting, module.stats.as_dict())
            out.backward(module.shard(dout))
            _matches_per_document(module, (q, k, v), (ql, kl, vl), out, dout, cu, causal,
                                  f"hybrid local documents causal={causal} {setting} {cu}")


@worker
def ulysses_document_groups(rank, world):
    """Ulysses pipelined by groups of packed documents: exact against every document alone in float64,
    forward and gradients, GQA split or replicated, batch 2, documents inside one shard and across
    shards (a group with no row on some rank included); per group three input all-to-alls and one
    output all-to-all forward; a planted wrong group (a document left out) fails the check."""
    from dilated.parallel.document_groups import document_groups_for

    n = 16 * world
    # the longest document (n - 20 rows) first, the second longest (8) last, the short ones between;
    # then eight of one length (a group of one document first and last)
    mixes = ([0, 3, 4, 9, 9 + (n - 20), n - 8, n], list(range(0, n + 1, 2 * world)))
    for causal, cu in ((False, mixes[0]), (True, mixes[0]), (True, mixes[1])):
        groups = document_groups_for(cu)
        assert len(groups) == 3 and sorted(d for g in groups for d in g) == list(range(len(cu) - 1)), groups
        for h, hkv in ((4 * world, 2 * world), (2 * world, 1)):
            q, k, v = _full(31 + hkv, n, h, hkv)
            module = dilated.UlyssesAttention(causal=causal, backend="manual", document_groups="always",
                                              local_documents=False)
            dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=q.dtype)
            ql, kl, vl = (module.shard(t).requires_grad_() for t in (q, k, v))
            module.stats.reset()
            out = module(ql, kl, vl, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
            assert module.stats.collectives == 2 * len(groups), module.stats.as_dict()  # q, k, v in; out back
            out.backward(module.shard(dout))
            _matches_per_document(module, (q, k, v), (ql, kl, vl), out, dout, cu, causal,
                                  f"ulysses document groups P={world} causal={causal} H={h}/{hkv}")
    # "auto": groups only where they make about one exchange's kernel calls; these tiny documents make
    # one varlen-sized call in one exchange and one per group in groups, so none, unless the share allows it
    from dilated.parallel import document_groups as dg

    q, k, v = _full(7, n, 2 * world, 2 * world, b=1)
    cu_t = torch.tensor(mixes[0], dtype=torch.int32)
    for share, collectives in ((dg.CALLS_SHARE, 2), (10.0, 2 * len(document_groups_for(mixes[0])))):
        dg.CALLS_SHARE, before = share, dg.CALLS_SHARE
        try:
            module = dilated.UlyssesAttention(causal=True, backend="manual", document_groups="auto",
                                              local_documents=False)
            module(*(module.shard(t) for t in (q, k, v)), cu_seqlens=cu_t)
            assert module.stats.collectives == collectives, (share, module.stats.as_dict())
        finally:
            dg.CALLS_SHARE = before
    # a wrong grouping (a document attended in no group) gives rows that no group wrote
    from dilated.parallel.document_groups import attend_by_document_groups
    from dilated.parallel.sharding import CommStats

    q, k, v = _full(5, n, 2 * world, 2 * world, b=1)
    cu = mixes[0]
    ql, kl, vl = (dilated.UlyssesAttention().shard(t) for t in (q, k, v))
    groups = document_groups_for(cu)

    def attend(qg, kg, vg, cu_g):
        return dilated.attention(qg, kg, vg, causal=True, backend="manual",
                                 cu_seqlens=torch.tensor(cu_g, dtype=torch.int32))
    got = attend_by_document_groups(ql, kl, vl, attend, cu=cu, groups=groups[:2], group=None, stats=CommStats())
    ref = dilated.UlyssesAttention().shard(_per_document(q, k, v, cu, True))
    left_out = [cu[d] for d in groups[2]]
    mine = [s - rank * (n // world) for s in left_out if rank * (n // world) <= s < (rank + 1) * (n // world)]
    if mine:
        assert _rel(got[:, mine[0]], ref[:, mine[0]]) > 1e-3, "a document in no group came out right"
    # bad values name the argument; head groups and document groups are one or the other
    for kw, says in (({"document_groups": 3}, "document_groups must be"),
                     ({"document_groups": True}, "document_groups must be"),
                     ({"document_groups": "always", "head_groups": 2}, "give one of them")):
        try:
            dilated.UlyssesAttention(**kw)
        except ValueError as e:
            assert says in str(e), str(e)
        else:
            raise AssertionError(f"{kw} was accepted")


@worker
def hybrid_row_documents(rank, world):
    """HybridAttention(2, 2, layout="documents", document_groups="always"): a row's pieces of documents
    across rows exchanged and ringed first, its whole documents behind them; exact against every
    document alone in float64, forward and gradients, causal or not, GQA split or replicated, batch 2;
    two exchanges' all-to-alls forward (three in, one out each) where every row holds both kinds, one
    exchange's where a row holds no whole document; bad settings named."""
    from dilated.parallel.row_documents import pipelines, row_plans

    n = 64  # rows of a rank's part: ring shards of 128 over two rows
    mixes = [([0, 5, 17, 30, 200, 210, 256], True),  # 170 rows cut head-tail over both rows, short ones whole
             ([0, 100, 101, 140, 150, 220, 256], True),
             ([0, 256], False)]  # one document: every row's pieces cross, no whole document
    # "auto", where no rank keeps documents of its own (local_documents=False), exchanges by documents
    # too; 1 exchanges at once
    for cu, pipelined in mixes:
        for causal, groups, h, hkv in ((True, "always", 4, 2), (False, "always", 4, 1), (True, "auto", 4, 1),
                                       (False, "auto", 4, 2), (True, 1, 4, 2)):
            module = dilated.HybridAttention(2, 2, causal=causal, layout="documents", backend="manual",
                                             local_documents=False, document_groups=groups)
            layout = module.document_layout(cu)
            assert pipelines(layout) == pipelined, (cu, layout.cut)
            q, k, v = _full(23 + h + hkv, 4 * n, h, hkv)
            dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
            ql, kl, vl = (module.shard(t, layout).requires_grad_() for t in (q, k, v))
            module.stats.reset()
            out = module(ql, kl, vl, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
            two = pipelined and groups != 1
            assert module.stats.collectives == (4 if two else 2), (cu, groups, module.stats.as_dict())
            out.backward(module.shard(dout))
            _matches_per_document(module, (q, k, v), (ql, kl, vl), out, dout, cu, causal,
                                  f"hybrid row documents causal={causal} groups={groups} H={h}/{hkv} {cu}")
    # each rank's documents within its part kept where they lie (local_documents="always"): a row of
    # crossing pieces (ring), documents across its ranks' parts (exchanged) and its own; one with no
    # crossing pieces; one whose rows differ (a ring only on one)
    mixes = [[0, 10, 25, 40, 70, 90, 100, 180, 190, 200, 215, 230, 256], [0, 60, 128, 188, 256],
             [0, 3, 9, 20, 34, 50, 66, 90, 97, 120, 140, 170, 175, 199, 230, 256]]
    for cu in mixes:
        for causal, groups in ((True, "always"), (False, "always"), (True, 1), (False, 1)):
            for h, hkv, batch in ((4, 2, 1), (4, 1, 2)):
                module = dilated.HybridAttention(2, 2, causal=causal, layout="documents", backend="manual",
                                                 local_documents="always", document_groups=groups)
                layout = module.document_layout(cu)
                plan = row_plans(layout, 2, "always", by_documents=groups == "always")[rank // 2]
                assert plan is not None and plan.local is not None, (cu, layout.cut)
                q, k, v = _full(31 + h + hkv, 4 * n, h, hkv, b=batch)
                dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6), dtype=q.dtype)
                ql, kl, vl = (module.shard(t, layout).requires_grad_() for t in (q, k, v))
                module.stats.reset()
                out = module(ql, kl, vl, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
                assert module.stats.collectives == 2 * len(plan.groups), (cu, plan, module.stats.as_dict())
                out.backward(module.shard(dout))
                _matches_per_document(module, (q, k, v), (ql, kl, vl), out, dout, cu, causal,
                                      f"hybrid rows, local, groups={groups} causal={causal} H={h}/{hkv} B={batch} {cu}")
    for kw, says in (({"document_groups": 2}, "document_groups must be 1"), ({"document_groups": True}, "got True"),
                     ({"document_groups": "always", "head_groups": 2}, "give one of them")):
        try:
            dilated.HybridAttention(2, 2, layout="documents", **kw)
        except ValueError as e:
            assert says in str(e), e
        else:
            raise AssertionError(f"HybridAttention({kw}) accepted")


@worker
def hybrid_local_rows_grids(rank, world, grids):
    """HybridAttention on the documents' layout with its defaults (each rank's documents within its
    part of the row kept where every row keeps some, the rest exchanged at once), and by documents,
    on every grid of ``grids`` (a ring of one row; a row of one rank), on a mix found for each grid
    whose rows keep documents: exact against every document alone in float64, forward and gradients."""
    import random

    from dilated.parallel.row_documents import row_plans

    n = 16 * world
    for ulysses_size, ring_size in grids:
        rng = random.Random(ulysses_size)
        for _ in range(200):  # the same draws on every rank
            cu = [0, *sorted(rng.sample(range(1, 4 * n), rng.randint(8, n // 2))), 4 * n]
            layout = dilated.DocumentLayout.balance(cu, ring_size, True)
            if row_plans(layout, ulysses_size, "always", False) and any(
                    p.groups for p in row_plans(layout, ulysses_size, "always", False)):
                break
        else:
            raise AssertionError(f"no mix of 200 keeps documents within the rows of {ring_size}x{ulysses_size}")
        for groups in (1, "always"):
            module = dilated.HybridAttention(ulysses_size, ring_size, causal=True, layout="documents",
                                             backend="manual", local_documents="always", document_groups=groups)
            q, k, v = _full(41 + ulysses_size, 4 * n, 4 * world, world)
            dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8), dtype=q.dtype)
            layout = module.document_layout(cu)
            ql, kl, vl = (module.shard(t, layout).requires_grad_() for t in (q, k, v))
            out = module(ql, kl, vl, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
            out.backward(module.shard(dout))
            _matches_per_document(module, (q, k, v), (ql, kl, vl), out, dout, cu, True,
                                  f"hybrid {ring_size}x{ulysses_size} local rows groups={groups} {cu}")


@worker
def all_to_all_parts(rank, world):
    """One exchange of several tensors (rows in blocks of uneven counts, some empty, features of
    other widths) delivers each block where an exchange per tensor would: rank ``j`` gets, from
    rank ``i``, rows ``send_counts[j]`` of each tensor that rank ``i`` made, in rank order; the
    bytes that leave a rank are counted once, as one collective."""
    from dilated.parallel.all_to_all import AllToAll
    from dilated.parallel.sharding import CommStats

    def counts(i):  # rows rank i sends to each rank: uneven, one empty
        return [(i + 2 * j) % 3 for j in range(world)]

    def made(i, width):  # rank i's tensor of this width: its values say whose row and which
        rows = sum(counts(i))
        return torch.arange(rows * width, dtype=torch.float64).view(rows, width) + 1000 * i + 100 * width

    widths = (1, 3, 2)
    stats = CommStats()
    mine = [made(rank, w) for w in widths]
    ex = AllToAll(mine, None, stats, counts(rank), [counts(i)[rank] for i in range(world)])
    got = ex.wait()
    for w, x in zip(widths, got):
        blocks = []
        for i in range(world):
            start = sum(counts(i)[:rank])
            blocks.append(made(i, w)[start:start + counts(i)[rank]])
        assert torch.equal(x, torch.cat(blocks)), (rank, w, x, blocks)
    sent = sum(counts(rank)) - counts(rank)[rank]
    assert stats.collectives == 1 and stats.bytes_sent == sent * sum(widths) * 8, stats.as_dict()
    # one tensor: the same through one all-to-all, returned as a tensor
    one = AllToAll(mine[1], None, stats, counts(rank), [counts(i)[rank] for i in range(world)]).wait()
    assert torch.equal(one, got[1])
