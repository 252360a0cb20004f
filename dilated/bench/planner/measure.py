"""``dilated-bench calibrate``: the measurements a :class:`~dilated.bench.planner.calibration.Calibration`
holds, taken on the GPUs at hand.

* Local attention calls (``dilated.attention`` on the chosen backend, bf16): per head shape, causal
  and not, forward and forward + backward, lengths 128 .. ``--longest`` rows, as one sequence and
  as batches that fill the GPU. Every rank times the same calls at once (as in a parallel run, all
  GPUs draw power together); each point is the mean of the ranks' medians.
* Communication among the launched ranks (one node; or one GPU on each of several nodes, for the
  links between nodes that ``plan --inter-node-calibration`` reads): send/recv round the ring, copy-engine pulls
  from the previous rank's memory where symmetric memory works, all-to-all, all-gather and
  reduce-scatter, 64 KiB .. 1 GiB per rank; each point is the slowest rank's median.
* Local calls on packed documents (a mix of 512 .. 16K-row documents, each length its own call, 16
  documents of 8K rows in one call, and a mix of 64 .. 2K-row documents, which the library runs in
  one varlen call for calls too small to fill the GPU): what the documents path costs beyond its
  kernels, per call and per row, and what its call of small documents takes beyond the model.
* Decode steps (:func:`dilated.decode_attention`, one query token) on one GPU alone and on the
  launched ranks together, per batch and cached rows per rank.
* Calls of the sequence-parallel strategies on the launched ranks (:data:`STRATEGIES`, at
  :data:`STRATEGY_ROWS` rows per rank), timed as the distributed benchmark times them: what a call
  of each costs beyond the model's kernels and bytes (its host work, its index copies and merges).

CUDA events after warm-up (:func:`dilated.bench.timing.measure`), L2 flushed between calls.
"""
from __future__ import annotations

import datetime
import statistics

import torch
import torch.distributed as dist

from ..env import environment
from ..timing import measure, measure_together
from .calibration import Calibration, Curve, DecodePoint, DocumentPoint, KernelPoint, StrategyPoint

#: the rows a device-filling calibration call holds (batch x length)
FILLING_ROWS = 65536
#: per-rank buffer sizes of the link measurements
LINK_BYTES = [1 << e for e in range(16, 31, 2)]
#: decode: cached rows per rank and batches timed (one query token), at most DECODE_BYTES of K/V per rank
#: (a point at 1M: a step's time bends between 512K and 2M rows, where a million-token cache on one GPU lies)
DECODE_TOKENS = [1 << 14, 1 << 17, 1 << 19, 1 << 20, 1 << 21]
DECODE_BATCHES = [1, 8]
DECODE_BYTES = 16 << 30
#: decode steps are timed called from Python and as replays of a CUDA graph (as serving engines run them)
DECODE_GRAPHS = (False, True)
#: strategies (benchmark names) timed on the launched ranks, at this many rows per rank (packed
#: documents of STRATEGY_DOCUMENTS for those on a document layout), causal
STRATEGIES = ("documents", "ring_documents", "ring_zigzag", "ulysses", "hybrid", "hybrid_documents")
STRATEGY_ROWS = 16384
STRATEGY_DOCUMENTS = "lognormal:8k,1.0"


def kernel_lengths(longest: int) -> list[int]:
    out, n = [], 128
    while n <= longest:
        out.append(n)
        n *= 2
    return out


def kernel_batches(length: int) -> list[int]:
    """One sequence; a batch of 8K rows where that is between; a batch of :data:`FILLING_ROWS` rows."""
    return sorted({1, max(1, 8192 // length), max(1, FILLING_ROWS // length)})


def _over_ranks(x: float, op: str) -> float:
    """``x`` of every launched rank: their ``"mean"`` or their ``"max"`` (``x`` itself on one rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(t) if op == "max" else float(t) / dist.get_world_size()


def _mean_over_ranks(x: float) -> float:
    return _over_ranks(x, "mean")


def _max_over_ranks(x: float) -> float:
    return _over_ranks(x, "max")


def _median(step, device, reps: int) -> float:
    return statistics.median(measure(step, device, warmup=2, reps=reps, budget_s=4.0))


def time_kernel(shape, length: int, batch: int, causal: bool, mode: str, device, backend: str, reps: int) -> float:
    """Median ms of one ``dilated.attention`` call (forward, or forward and backward)."""
    import dilated

    h, hkv, d = shape
    grad = mode == "fwd_bwd"
    q = torch.randn(batch, length, h, d, device=device, dtype=torch.bfloat16, requires_grad=grad)
    k, v = (torch.randn(batch, length, hkv, d, device=device, dtype=torch.bfloat16, requires_grad=grad)
            for _ in range(2))
    dout = torch.randn_like(q)

    def step():
        if grad:
            out = dilated.attention(q, k, v, causal=causal, backend=backend)
            torch.autograd.grad(out, (q, k, v), dout)
        else:
            with torch.no_grad():
                dilated.attention(q, k, v, causal=causal, backend=backend)
    return _median(step, device, reps)


def measure_kernels(shapes, longest: int, device, backend: str, reps: int = 5, log=print) -> list[KernelPoint]:
    points = []
    for shape in shapes:
        for mode in ("fwd", "fwd_bwd"):
            for causal in (True, False):
                for n in kernel_lengths(longest):
                    for b in kernel_batches(n):
                        try:
                            ms = time_kernel(shape, n, b, causal, mode, device, backend, reps)
                        except torch.OutOfMemoryError:
                            ms = float("nan")
                        torch.cuda.empty_cache()
                        ms, slowest = _mean_over_ranks(ms), _max_over_ranks(ms)
                        many = dist.is_initialized() and dist.get_world_size() > 1
                        if ms == ms:
                            points.append(KernelPoint(*shape, causal, mode, n, b, ms,
                                                      slowest_ms=slowest if many else None))
                            log(f"kernel {shape} {mode} {'causal' if causal else 'full'} {b} x {n}: {ms:.3f} ms")
    return points


def _pattern_step(name: str, nbytes: int, device, group=None):
    """``(step, moved bytes per rank)`` of one pattern with a buffer of ``nbytes`` per rank, or None
    where it does not run here."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    numel = nbytes // 2
    x = torch.randn(numel, device=device, dtype=torch.bfloat16)
    if name == "p2p":
        y = torch.empty_like(x)
        nxt, prv = (r + 1) % p, (r - 1) % p

        def step():
            ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, y, prv, group)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return step, nbytes
    if name == "copy_engine":
        from ...parallel import peer_copy

        if peer_copy.prepare(group, device, max(nbytes, LINK_BYTES[-1])) is not None:  # one buffer for every size
            return None
        published = peer_copy.Published(group, [x.view(1, -1)])
        out = [torch.empty_like(x).view(1, -1)]
        side, cur = peer_copy.side_stream(device), torch.cuda.current_stream(device)

        def step():
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                published.pull((r - 1) % p, slice(0, numel), out)
            cur.wait_stream(side)
        return step, nbytes
    if name == "all_to_all":
        y = torch.empty_like(x)
        return (lambda: dist.all_to_all_single(y, x, group=group)), nbytes * (p - 1) / p
    if name == "all_gather":
        y = x.new_empty(p * numel)
        return (lambda: dist.all_gather_into_tensor(y, x, group=group)), nbytes * (p - 1)
    if name == "reduce_scatter":
        y = x.new_empty(numel // p)
        return (lambda: dist.reduce_scatter_tensor(y, x, group=group)), nbytes * (p - 1) / p
    raise ValueError(name)


def measure_links(device, reps: int = 10, log=print) -> dict[str, Curve]:
    """Every pattern at :data:`LINK_BYTES`; a pattern that does not run here is left out."""
    p = dist.get_world_size()
    curves = {}
    for name in ("p2p", "copy_engine", "all_to_all", "all_gather", "reduce_scatter"):
        moved, times = [], []
        for nbytes in LINK_BYTES:
            made = _pattern_step(name, nbytes, device)
            ok = _max_over_ranks(0.0 if made is not None else 1.0) == 0.0
            if not ok:
                log(f"{name}: does not run here; left out")
                break
            dist.barrier()  # every rank starts together: a collective's time, not a straggler's
            ms = _max_over_ranks(statistics.median(measure(made[0], device, warmup=3, reps=reps, flush_l2=False)))
            moved.append(made[1])
            times.append(ms)
            log(f"{name} {nbytes >> 10} KiB per rank: {ms:.3f} ms")
        if moved:
            curves[name] = Curve(moved, times, p)
    return curves


def document_mix(longest: int = 16384) -> tuple:
    """Cumulative lengths of a calibration mix: documents of 512 up to ``longest`` rows, each length
    1.3x the last (each its own call, causal or not), twice over."""
    lengths, m = [], 512
    while m <= longest:
        lengths.append(m)
        m = int(m * 1.3) // 8 * 8
    cu = [0]
    for m in lengths * 2:
        cu.append(cu[-1] + m)
    return tuple(cu)


def time_documents(shape, cu, causal: bool, mode: str, device, backend: str, reps: int) -> float:
    """Median ms of ``dilated.attention`` on the packed documents ``cu`` (forward, or forward and backward)."""
    import dilated

    h, hkv, d = shape
    n, grad = cu[-1], mode == "fwd_bwd"
    q = torch.randn(1, n, h, d, device=device, dtype=torch.bfloat16, requires_grad=grad)
    k, v = (torch.randn(1, n, hkv, d, device=device, dtype=torch.bfloat16, requires_grad=grad) for _ in range(2))
    dout, cu_t = torch.randn_like(q), torch.tensor(cu, dtype=torch.int32)  # on the host, as the harness's

    def step():
        if grad:
            out = dilated.attention(q, k, v, causal=causal, backend=backend, cu_seqlens=cu_t)
            torch.autograd.grad(out, (q, k, v), dout)
        else:
            with torch.no_grad():
                dilated.attention(q, k, v, causal=causal, backend=backend, cu_seqlens=cu_t)
    return _median(step, device, reps)


def one_length_mix(length: int = 8192, count: int = 16) -> tuple:
    """Cumulative lengths of ``count`` documents of ``length`` rows: one batched call of many rows,
    beside :func:`document_mix`'s many calls (the two part the documents path's cost per call from
    its cost per row)."""
    return tuple(range(0, length * count + 1, length))


def short_mix(shortest: int = 64, longest: int = 2048, times: int = 4) -> tuple:
    """Cumulative lengths of short documents, ``shortest`` up to ``longest`` rows, each length 1.3x the
    last, ``times`` over: calls too small to fill the GPU, which ``auto`` runs as one call of torch's
    varlen kernel (:func:`dilated.packed.split_small_calls`)."""
    lengths, m = [], shortest
    while m <= longest:
        lengths.append(m)
        m = int(m * 1.3) // 8 * 8
    cu = [0]
    for m in lengths * times:
        cu.append(cu[-1] + m)
    return tuple(cu)


def measure_documents(shapes, device, backend: str, reps: int = 10, log=print) -> list[DocumentPoint]:
    points = []
    for cu in (document_mix(), one_length_mix(), short_mix()):
        for shape in shapes:
            for mode in ("fwd", "fwd_bwd"):
                for causal in (True, False):
                    ms = _mean_over_ranks(time_documents(shape, cu, causal, mode, device, backend, reps))
                    points.append(DocumentPoint(*shape, causal, mode, cu, ms))
                    log(f"documents {shape} {mode} {'causal' if causal else 'full'} {len(cu) - 1} documents: "
                        f"{ms:.3f} ms")
    return points


def decode_rank_counts(world: int) -> list[int]:
    """The rank counts decode steps are timed on: one GPU, the powers of two below the world, the world."""
    return sorted({1, world} | {1 << i for i in range(1, world.bit_length()) if 1 << i < world})


def measure_decode(device, shape=(32, 8, 128), reps: int = 30, log=print) -> list[DecodePoint]:
    """Decode steps of one query token on the first P ranks for each P of :func:`decode_rank_counts` (the
    others waiting, as the decode benchmark runs its rows), per batch and cached rows per rank (at most
    :data:`DECODE_BYTES` of cache per rank)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    points = []
    for ranks in decode_rank_counts(world):
        group = dist.new_group(list(range(ranks))) if 1 < ranks < world else None  # every rank makes it
        for b in DECODE_BATCHES:
            for s in DECODE_TOKENS:
                if b * s * shape[1] * shape[2] * 2 * 2 > DECODE_BYTES:
                    continue
                for graph in DECODE_GRAPHS if device.type == "cuda" else (False,):
                    ms = _decode_ms(ranks, group, b, s, shape, device, reps, graph)
                    points.append(DecodePoint(ranks, b, s, *shape, ms, graph))
                    log(f"decode on {ranks} rank(s), batch {b}, {s} cached rows per rank"
                        f"{', replayed from a CUDA graph' if graph else ''}: {ms:.3f} ms")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return points


def _decode_ms(ranks: int, group, b: int, s: int, shape, device, reps: int, cuda_graph: bool = False) -> float:
    """Median ms of a decode step over ``s`` cached rows of ``b`` sequences on the first ``ranks`` ranks
    (``group``; the others wait), on every rank: on the first GPU alone for 1
    (:func:`~dilated.parallel.decode_attention.local_part`, as ``decode_attention`` runs without a process
    group), else each step started together, the median of its slowest rank's times
    (:func:`~dilated.bench.timing.measure_together`); ``cuda_graph``: replays of the step captured in a
    CUDA graph."""
    from ...parallel.decode_attention import decode_attention, local_part

    ms = 0.0
    if not dist.is_initialized() or dist.get_rank() < ranks:
        h, hkv, d = shape
        q = torch.randn(b, 1, h, d, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, hkv, d, device=device, dtype=torch.bfloat16) for _ in range(2))
        with torch.no_grad():
            if ranks == 1:
                ms = statistics.median(measure(lambda: local_part(q, k, v, None, "auto")[0].to(q.dtype), device,
                                               warmup=5, reps=reps, cuda_graph=cuda_graph))
            else:
                step = lambda: decode_attention(q, k, v, group)  # noqa: E731
                step()  # the group's communicator made before any capture
                ms = statistics.median(measure_together(step, device, group, warmup=5, reps=reps,
                                                        cuda_graph=cuda_graph)[0])
    return _max_over_ranks(ms)  # the ranks that waited give 0


def measure_strategies(shape, device, backend: str, reps: int = 10, log=print) -> list[StrategyPoint]:
    """Each of :data:`STRATEGIES` that runs on the launched ranks, forward and forward + backward, on
    ``STRATEGY_ROWS`` rows per rank of the head shape ``shape``, as the distributed benchmark calls
    it (random shards, a barrier before each call, L2 flushed): the slowest rank's median."""
    from ..registry import Case
    from ..strategies import RING_IMPLEMENTATIONS

    h, hkv, d = shape
    p = dist.get_world_size()
    points = []
    for name in STRATEGIES:
        impl = RING_IMPLEMENTATIONS[name]
        documents = STRATEGY_DOCUMENTS if impl.layout in ("documents", "hybrid_documents") else None
        for mode in ("fwd", "fwd_bwd"):
            case = Case(1, p * STRATEGY_ROWS, h, d, hkv, causal=True, mode=mode, documents=documents)
            try:
                ms = _max_over_ranks(_strategy_ms(impl, case, device, backend, reps))
            except (NotImplementedError, ValueError) as e:
                log(f"strategy {name}: does not run on {p} ranks ({e}); left out")
                break
            torch.cuda.empty_cache()
            points.append(StrategyPoint(name, p, mode, case.seq_len, h, hkv, d, True, documents, ms))
            log(f"strategy {name} {mode} on {p} ranks, {STRATEGY_ROWS} rows each: {ms:.3f} ms")
    return points


def _strategy_ms(impl, case, device, backend: str, reps: int) -> float:
    """This rank's median ms of ``impl`` (a distributed benchmark implementation) on ``case``."""
    model = impl.build(case, backend)
    grad = case.mode == "fwd_bwd"
    q, k, v = impl.inputs(case, device, torch.Generator().manual_seed(0), grad)
    dout = torch.randn_like(q)

    def step():
        if grad:
            torch.autograd.grad(model(q, k, v), (q, k, v), dout)
        else:
            with torch.no_grad():
                model(q, k, v)
    return statistics.median(measure(step, device, warmup=3, reps=reps, setup=dist.barrier))


def calibrate(shapes, longest: int, device, backend: str = "auto", command: str = "", log=print) -> Calibration:
    """All of the measurements on the launched ranks (links only where there are several)."""
    links = measure_links(device, log=log) if dist.is_initialized() and dist.get_world_size() > 1 else {}
    kernels = measure_kernels(shapes, longest, device, backend, log=log)
    documents = measure_documents(shapes, device, backend, log=log)
    decode = measure_decode(device, log=log)
    many = dist.is_initialized() and dist.get_world_size() > 1
    strategies = measure_strategies(shapes[0], device, backend, log=log) if many else []
    env = environment()
    software = {k: env.get(k) for k in ("torch", "cuda", "cudnn", "triton", "flash_attn_4", "driver", "git_commit")}
    props = torch.cuda.get_device_properties(device)
    from ...backends.varlen import varlen_kernel
    from ...packed import halves_backend

    h, hkv, d = shapes[0]  # the varlen kernel the documents path takes for a long shard (auto's pick is by shape)
    probe = [torch.randn(1, longest, x, d, device=device, dtype=torch.bfloat16) for x in (h, hkv, hkv)]
    varlen = varlen_kernel(*probe, backend, True)
    halves = varlen_kernel(*probe, backend, False) is None and halves_backend(backend, *probe, False) is not None
    gpus = dist.get_world_size() if dist.is_initialized() else 1
    hosts = [None] * gpus
    if gpus > 1:
        import socket

        dist.all_gather_object(hosts, socket.gethostname())
    return Calibration(device=torch.cuda.get_device_name(device), gpus=gpus,
                       memory_gib=props.total_memory / 2**30, software=software, kernels=kernels, links=links,
                       documents=documents, decode=decode, strategies=strategies, backend=backend,
                       varlen_kernel=None if varlen is None else varlen.name, document_halves=halves,
                       nodes=len(set(hosts)), command=command,
                       created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
