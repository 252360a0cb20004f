"""Context-parallel strategies beside the ring: Ulysses and the Ulysses x ring hybrid, on real gloo
process groups, exact against a float64 reference forward and backward."""
import math
from pathlib import Path
from unittest import mock

import pytest
import torch

import cp_worker
from conftest import free_port, spawn, usage_error
import dilated


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_is_exact_forward_and_backward(world):
    spawn(cp_worker.ulysses, args=(world, free_port()), nprocs=world)


@pytest.mark.parametrize("world, grids", [(4, [(2, 2), (4, 1), (1, 4)]), (6, [(2, 3), (3, 2)])])
def test_hybrid_grids_are_exact_forward_and_backward(world, grids):
    spawn(cp_worker.hybrid, args=(world, free_port(), grids), nprocs=world)


def test_every_sequence_parallel_module_shards_and_unshards_in_its_layout():
    spawn(cp_worker.shard_methods, args=(2, free_port()), nprocs=2)


def test_ulysses_keeps_attention_within_packed_documents():
    spawn(cp_worker.ulysses_documents, args=(2, free_port()), nprocs=2)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_hybrid_keep_attention_within_packed_documents(world):
    spawn(cp_worker.ring_documents, args=(world, free_port()), nprocs=world)


@pytest.mark.parametrize("how", ["torch", "small"])
def test_ring_runs_a_chunks_documents_in_the_kernels_varlen_entry_point(how):
    """With a varlen kernel (a stand-in of torch's ops), ring and zigzag ring run the documents of
    each chunk with itself in it, forward and backward on the merged out and lse: exact. ``small``:
    as the kernel for documents too small for batched calls (``auto`` on cuDNN)."""
    spawn(cp_worker.ring_documents, args=(2, free_port(), how), nprocs=2)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_documents_of_a_chunk_with_itself_are_one_batched_entry(layout):
    """A ring step's pair of a chunk with itself holds all of the chunk's documents: one entry
    carrying their boundaries (run in a few batched calls), not one kernel call per document;
    pairs of different chunks share at most one document."""
    from dilated.parallel.ring_attention import _chunks, _pieces, _plan

    n, p = 16, 2  # local length, ranks
    cu = list(range(0, 2 * n, 2)) + [2 * n]  # documents of 2 positions each
    for causal in (False, True):
        for rank in range(p):
            for src in range(p):
                pieces = _pieces(_plan(src, rank, n, causal, layout), src, rank, p, n, layout, cu)
                own = [pc for pc in pieces if pc[3] is not None]
                if src == rank:  # every chunk of the shard with itself: one entry each, all its documents
                    assert len(own) == len(_chunks(rank, p, n, layout))
                    assert all(pc[3] == list(range(0, pc[0].stop - pc[0].start + 1, 2)) and pc[2] == causal
                               for pc in own)
                assert all(pc[0].stop - pc[0].start <= 2 for pc in pieces if pc[3] is None)


def test_every_strategy_on_one_document_workload_under_torchrun(tmp_path):
    """The ring script on 4 CPU ranks: ring, zigzag, Ulysses and the hybrids on one packed-document
    problem with GQA, every row checked against each document alone, with its work imbalance."""
    from test_distributed import _torchrun

    rows, stdout = _torchrun("benchmarks/specialized/benchmark_ring_attention.py", 4, tmp_path, "--seq-lengths",
                             "256", "--causal", "--doc-lengths", "lognormal:32,1.0", "--head-shapes", "8/2/32,4/4/16",
                             "--implementations",
                             "ring,ring_zigzag,ulysses,hybrid,hybrid_documents_row_groups,"
                             "hybrid_documents_row_groups_local,torch_cp")
    tables = [line for line in stdout.splitlines() if line.endswith("every implementation")]
    assert len(tables) == 2 and "H=8/2 D=32" in tables[0] + tables[1] and "H=4 D=16" in tables[0] + tables[1]
    assert all("documents lognormal:32,1.0: every implementation" in t for t in tables)
    rows = [r for r in rows if r["config"]["num_heads"] == 8]  # the GQA shape below
    by = {r["implementation"]: r for r in rows if r.get("role") != "baseline"}
    for name in ("ring", "ring_zigzag", "ulysses", "hybrid", "hybrid_documents_row_groups",
                 "hybrid_documents_row_groups_local"):
        assert by[name]["status"] == "ok" and by[name]["check"]["passed"], by[name]
        assert by[name]["config"]["documents"] == "lognormal:32,1.0"
    assert by["ulysses"]["work_imbalance"] == 1.0 and by["ring"]["work_imbalance"] > 1.0
    for name in ("ring", "ulysses"):  # each rank's own median, and the slowest over the mean
        times = by[name]["rank_median_ms"]
        assert len(times) == 4 and by[name]["time_imbalance"] == pytest.approx(max(times) / (sum(times) / 4))
    assert by["torch_cp"]["status"] == "unsupported" and "documents" in by["torch_cp"]["reason"]
    base = next(r for r in rows if r.get("role") == "baseline")
    assert base["config"]["documents"] == "lognormal:32,1.0" and base["check"]["passed"]
    assert "work imb" in stdout and "time imb" in stdout


def test_document_length_generators_have_their_stated_mean_and_range():
    """Lengths drawn by each spec against what the spec says: lognormal:MEAN,SIGMA has mean MEAN (the
    log-mean is log MEAN - SIGMA^2 / 2) and median MEAN x exp(-SIGMA^2 / 2); uniform:LO-HI takes
    every length from LO to HI and no other, mean (LO + HI) / 2; fixed:L every length L; every spec
    packs exactly N positions, only the last document cut."""
    import statistics

    from dilated.bench.documents import cu_seqlens_of

    def lengths(spec, n):
        cu = cu_seqlens_of(spec, n)
        assert cu[0] == 0 and cu[-1] == n and all(b > a for a, b in zip(cu, cu[1:]))
        return [b - a for a, b in zip(cu, cu[1:])][:-1]  # the last one is cut at N

    n = 1 << 22
    for mean, sigma in ((1000, 0.5), (1000, 1.0)):
        got = lengths(f"lognormal:{mean},{sigma}", n)  # about 4000 documents: the mean within a few %
        assert statistics.fmean(got) == pytest.approx(mean, rel=0.05), (mean, sigma)
        assert statistics.median(got) == pytest.approx(mean * math.exp(-sigma * sigma / 2), rel=0.06), (mean, sigma)
    got = lengths("uniform:10-13", 10_000)
    assert set(got) == {10, 11, 12, 13} and statistics.fmean(got) == pytest.approx(11.5, rel=0.03)
    assert set(lengths("fixed:300", 10_000)) == {300}
    assert lengths("lognormal:100,1.0#1", 50_000) != lengths("lognormal:100,1.0#2", 50_000)  # draws differ


def test_document_workloads_by_hand():
    from dilated.bench.workload import imbalance, work_per_rank as _work_per_rank
    from dilated.bench.documents import attended_pairs, cu_seqlens_of, parse_spec
    from dilated.bench.problems import DenseAttention
    from dilated.bench.registry import Case

    assert cu_seqlens_of("fixed:3", 8) == (0, 3, 6, 8)  # the last document cut at N
    cu = cu_seqlens_of("lognormal:100,1.5", 4096)
    assert cu == cu_seqlens_of("lognormal:100,1.5", 4096) and cu[-1] == 4096 and len(cu) > 10  # seeded
    assert cu_seqlens_of("uniform:10-20", 1000)[1] in range(10, 21)
    assert attended_pairs((0, 3, 8), causal=True) == 6 + 15 and attended_pairs((0, 3, 8), causal=False) == 9 + 25
    case = Case(batch=2, seq_len=8, num_heads=4, head_dim=16, causal=True, documents="fixed:4")
    assert DenseAttention().flops(case, "fwd") == 2 * 2 * 4 * (10 + 10) * 32
    # causal, one document: contiguous shards of 4 queries see 1..4 / 5..8 keys; zigzag balances
    one = Case(batch=1, seq_len=8, num_heads=1, head_dim=8, causal=True)
    assert _work_per_rank(one, 2, "contiguous") == [10.0, 26.0]
    assert _work_per_rank(one, 2, "zigzag") == [1 + 2 + 7 + 8, 3 + 4 + 5 + 6]
    assert imbalance([10.0, 26.0]) == 26 / 18
    for bad in ("fixed", "uniform:9-3", "lognormal:100", "lognormal:100,-1", "zipf:3"):
        with pytest.raises(ValueError, match="fixed:LEN, uniform:MIN-MAX or lognormal:MEAN,SIGMA"):
            parse_spec(bad)


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_dilated_takes_any_schedule_and_world_size(world):
    spawn(cp_worker.dilated_any_schedule, args=(world, free_port()), nprocs=world)


@pytest.mark.parametrize("args, says", [(["--head-shapes", "llama3-8b", "--num-heads", "8"], "give the heads one way"),
                                        (["--head-shapes", "32/7/128"], "Hkv dividing H"),
                                        (["--head-shapes", "32x128"], "H/Hkv/D")])
def test_head_shapes_are_checked_before_any_work(args, says, tmp_path):
    from dilated.bench.suites import ring_main  # benchmarks/specialized/benchmark_ring_attention.py's main

    code, err = usage_error(ring_main, [*args, "--output", str(tmp_path / "o.jsonl")])
    assert code == 2 and says in err and not (tmp_path / "o.jsonl").exists()


def test_model_head_shapes():
    from dilated.bench.suites.distributed import head_shapes

    assert head_shapes("llama3-8b,16/16/128") == [(32, 8, 128), (16, 16, 128)]


def test_yunchang_rows_say_what_its_torch_attention_cannot_do(monkeypatch):
    """Without flash-attn 2, yunchang 0.6.4 runs its torch ring: forward only, no GQA, CUDA only.
    The adapter says so instead of failing inside yunchang (stand-in of its API: tests/standins)."""
    import sys

    import torch.distributed as dist
    from dilated.bench.external_ring import EXTERNAL_RINGS
    from dilated.bench.registry import Case

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "standins"))
    for name in [m for m in sys.modules if m == "yunchang" or m.startswith("yunchang.")]:
        monkeypatch.delitem(sys.modules, name)
    import yunchang.globals

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        usp, ulysses = EXTERNAL_RINGS["yunchang_usp"], EXTERNAL_RINGS["yunchang_ulysses"]
        monkeypatch.setattr(yunchang.globals, "HAS_FLASH_ATTN", False)
        with pytest.raises(NotImplementedError, match="no backward"):
            usp.factory(Case(1, 64, 4, 16, mode="fwd_bwd"), "auto", None)
        with pytest.raises(NotImplementedError, match="as many k/v heads"):
            ulysses.factory(Case(1, 64, 4, 16, num_kv_heads=2), "auto", None)
        q = torch.randn(1, 64, 4, 16)
        with pytest.raises(NotImplementedError, match="CUDA only"):
            usp.factory(Case(1, 64, 4, 16), "auto", None)(q, q, q)
        monkeypatch.setattr(yunchang.globals, "HAS_FLASH_ATTN", True)
        with pytest.raises(NotImplementedError, match="launched world size only"):
            usp.factory(Case(1, 64, 4, 16), "auto", dist.group.WORLD)
        for _ in range(2):  # its groups are made once per grid, not per row
            out = ulysses.factory(Case(1, 64, 4, 16, num_kv_heads=2, mode="fwd_bwd"), "auto", None)(q, q[:, :, :2],
                                                                                                      q[:, :, :2])
        assert out.shape == q.shape and yunchang.globals.DEGREES == [(1, 1)]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, configs", [(2, 30), (3, 30), (4, 30), (6, 12)])  # 6 processes on CI's 2 cores: fewer
def test_random_configurations_of_every_sequence_parallel_module(world, configs):
    """Ring, zigzag ring, Ulysses, every hybrid grid and distributed dilated attention on seeded
    random shapes, GQA ratios, documents and schedules (tests/cp_worker.py), exact against float64."""
    spawn(cp_worker.random_configurations, args=(world, free_port(), range(configs)), nprocs=world)


def test_pytorchs_per_document_balancer_is_the_torch_cp_row_for_documents(tmp_path):
    """PyTorch's context parallel on packed documents runs as its authors document it (flex_attention,
    a document block mask, its per-document head-tail balancer), gathered through its own unshard and
    checked against each document alone; documents its balancer cannot split say so."""
    from test_distributed import _torchrun

    rows, _ = _torchrun("benchmarks/specialized/benchmark_ring_attention.py", 2, tmp_path, "--seq-lengths", "256",
                        "--causal", "--doc-lengths", "fixed:64;fixed:62", "--head-shapes", "4/2/16", "--mode", "fwd",
                        "--implementations", "torch_cp")
    row = {r["config"]["documents"]: r for r in rows if r["implementation"] == "torch_cp"}
    assert row["fixed:64"]["status"] == "ok" and row["fixed:64"]["check"]["passed"], row["fixed:64"]
    assert row["fixed:64"]["check"]["rel_err"] < 1e-5, row["fixed:64"]
    assert row["fixed:62"]["status"] == "unsupported" and "multiple of 2P = 4" in row["fixed:62"]["reason"], row


def test_pytorchs_per_document_layout_work_by_hand():
    """PyTorch's per-document head-tail order, counted by hand: documents of 8 and 16, P=2, causal.
    Its order is [0,1,6,7,2,3,4,5 | 8-11,20-23,12-19], cut into two shards of 12: rank 0 holds doc 0
    (keys 1+2+7+8+3+4+5+6 = 36) and doc 1's 8-11 (1+2+3+4 = 10); rank 1 doc 1's 20-23 (13..16 = 58)
    and 12-19 (5..12 = 68)."""
    from dilated.bench.registry import Case
    from dilated.bench.workload import documents_work_per_rank, imbalance, per_document_order, work_per_rank

    assert per_document_order((0, 8, 24), 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5, 8, 9, 10, 11, 20, 21, 22, 23,
                                                          12, 13, 14, 15, 16, 17, 18, 19]
    one = Case(batch=1, seq_len=8, num_heads=1, head_dim=8, causal=True)
    assert work_per_rank(one, 2, "per_document") == [18.0, 18.0]  # one document: balanced
    work = documents_work_per_rank((0, 8, 24), True, 2, "per_document")
    assert work == [46.0, 126.0] and imbalance(work) == pytest.approx(126 / 86)
    assert documents_work_per_rank((0, 8, 24), False, 2, "per_document") == [8 * 8 + 4 * 16, 16 * 12]


@pytest.mark.parametrize("kernel", ["torch", "fa4"])
def test_document_parallel_attention_in_the_kernels_varlen_entry_points(kernel):
    spawn(cp_worker.documents_varlen, args=(2, free_port(), kernel), nprocs=2)


@pytest.mark.parametrize("world", [2, 3])
def test_small_crossing_rectangles_run_in_torchs_varlen_kernel(world):
    spawn(cp_worker.documents_small_rectangles, args=(world, free_port()), nprocs=world)


def _causal_keys(cu) -> torch.Tensor:
    """The keys each position attends, causal within its document (a float64 loop)."""
    keys = torch.zeros(cu[-1], dtype=torch.float64)
    for a, b in zip(cu, cu[1:]):
        for i in range(a, b):
            keys[i] = i - a + 1
    return keys


def test_hybrid_on_the_document_layout_work_by_hand():
    """The work of each rank of a 2x2 grid whose ring runs on the documents' layout, counted by
    hand: the keys each position attends (a float64 loop over the documents), summed over the
    positions the layout gives the rank's ring row, halved between the row's two ranks (each takes
    half the heads)."""
    from dilated.bench.distributed import DistributedImplementation
    from dilated.bench.registry import Case
    from dilated.bench.strategies import RING_IMPLEMENTATIONS

    cu = (0, 40, 46, 100, 128)
    case = Case(batch=1, seq_len=128, num_heads=4, head_dim=8, causal=True, documents="given")
    keys = _causal_keys(cu)
    layout = dilated.DocumentLayout.balance(cu, 2, True)
    by_hand = [float(keys[layout.positions(r // 2)].sum()) / 2 for r in range(4)]
    impl = RING_IMPLEMENTATIONS["hybrid_documents"]
    assert isinstance(impl, DistributedImplementation) and impl.layout == "hybrid_documents"
    with mock.patch("dilated.bench.documents.cu_seqlens_of", return_value=cu):
        assert impl.work_per_rank(case, 4) == by_hand
        assert RING_IMPLEMENTATIONS["ring_documents"].work_per_rank(case, 4) == [
            float(keys[dilated.DocumentLayout.balance(cu, 4, True).positions(r)].sum()) for r in range(4)]
    assert sum(by_hand) == float(keys.sum())



def test_the_ring_on_the_head_tail_layout_work_by_hand():
    """``ring_head_tail``'s work per rank, counted by hand: documents of 20, 24 and 84 positions,
    P=2, causal, each cut into four chunks of which rank 0 holds the first and last, rank 1 the
    middle two; the keys of those positions summed (a float64 loop over the documents). The
    balanced layout of these documents gives other work (2042 and 2038)."""
    from dilated.bench.registry import Case
    from dilated.bench.strategies import RING_IMPLEMENTATIONS

    cu = (0, 20, 44, 128)
    keys = _causal_keys(cu)
    mine = [[*range(0, 5), *range(15, 20), *range(20, 26), *range(38, 44), *range(44, 65), *range(107, 128)],
            [*range(5, 15), *range(26, 38), *range(65, 107)]]
    case = Case(batch=1, seq_len=128, num_heads=4, head_dim=8, causal=True, documents="given")
    with mock.patch("dilated.bench.documents.cu_seqlens_of", return_value=cu):
        work = RING_IMPLEMENTATIONS["ring_head_tail"].work_per_rank(case, 2)
    assert work == [float(keys[m].sum()) for m in mine]


def test_the_hybrids_row_exchange_by_documents_is_exact():
    spawn(cp_worker.hybrid_row_documents, args=(4, free_port()), nprocs=4)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_attends_documents_where_they_lie_exactly(world):
    spawn(cp_worker.ulysses_local_documents, args=(world, free_port()), nprocs=world)


@pytest.mark.parametrize("world", [2, 4])
def test_own_documents_attend_beside_the_input_and_the_output_exchanges(world):
    spawn(cp_worker.local_documents_beside_both_exchanges, args=(world, free_port()), nprocs=world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_by_groups_of_documents_is_exact(world):
    spawn(cp_worker.ulysses_document_groups, args=(world, free_port()), nprocs=world)


@pytest.mark.parametrize("spec, n, one_call, grouped", [
    ("lognormal:8k,1.0", 1 << 18, False, True),   # documents of many lengths: about one exchange's calls
    ("lognormal:8k,1.0", 1 << 20, False, True),
    ("fixed:8k", 1 << 18, False, False),          # one batched call would become one per group
    ("fixed:32k", 1 << 20, False, False),
    ("lognormal:8k,1.0", 1 << 18, True, False),   # one varlen call would become one per group
])
def test_document_groups_auto_takes_groups_only_where_the_calls_stay_about_the_same(spec, n, one_call, grouped):
    """``document_groups="auto"`` on the mixes measured both ways (Llama-3-8B heads at P=4: 8 query
    heads a rank after the exchange): groups on the documents of many lengths in batched calls, one
    exchange on documents of one length or where one varlen call serves them all."""
    from dilated.bench.documents import cu_seqlens_of
    from dilated.parallel.document_groups import document_groups_for, groups_to_use

    cu = cu_seqlens_of(spec, n)
    assert groups_to_use("auto", cu, 8, 128, True, one_call) == (document_groups_for(cu) if grouped else None)
    assert groups_to_use("always", cu, 8, 128, True, one_call) == document_groups_for(cu)
    assert groups_to_use(1, cu, 8, 128, True, one_call) is None


def test_the_hybrids_row_exchange_with_local_documents_work_by_hand():
    """Each rank of a 2x2 grid exchanging its row by documents with local documents: the keys of the
    documents whose positions all lie in the rank's half of its row's positions, plus half of the
    rest of the row's keys (a float64 loop over the positions; a mix where "auto" keeps every such
    document)."""
    from dilated.bench.registry import Case
    from dilated.bench.strategies import RING_IMPLEMENTATIONS

    cu = (0, 6, 12, 23, 25, 43, 53, 66, 81, 87, 88, 102, 105, 165, 173, 179, 195, 210, 227, 233, 237, 255, 256)
    case = Case(batch=1, seq_len=256, num_heads=4, head_dim=8, causal=True, documents="given")
    keys = _causal_keys(cu)
    layout = dilated.DocumentLayout.balance(cu, 2, True)
    by_hand = []
    for row in range(2):
        mine = layout.positions(row).tolist()
        parts = [set(mine[:64]), set(mine[64:])]
        own = [sum(float(keys[a:b].sum()) for a, b in zip(cu, cu[1:]) if set(range(a, b)) <= part) for part in parts]
        rest = float(keys[mine].sum()) - sum(own)
        by_hand += [w + rest / 2 for w in own]
    assert by_hand[0] != by_hand[1]  # the halves' own documents differ
    with mock.patch("dilated.bench.documents.cu_seqlens_of", return_value=cu):
        assert RING_IMPLEMENTATIONS["hybrid_documents_row_groups_local"].work_per_rank(case, 4) == \
            pytest.approx(by_hand)
        assert RING_IMPLEMENTATIONS["hybrid_documents_row_groups"].work_per_rank(case, 4) == pytest.approx(
            [float(keys[layout.positions(r // 2)].sum()) / 2 for r in range(4)])


@pytest.mark.parametrize("world, grids", [(4, [(2, 2), (4, 1), (1, 4)]), (6, [(3, 2), (2, 3)])])
def test_the_hybrid_keeps_documents_within_its_rows_on_every_grid(world, grids):
    spawn(cp_worker.hybrid_local_rows_grids, args=(world, free_port(), grids), nprocs=world)


@pytest.mark.parametrize("world", [2, 3])
def test_one_exchange_of_several_tensors_delivers_each_block(world):
    spawn(cp_worker.all_to_all_parts, args=(world, free_port()), nprocs=world)


def test_the_harness_counts_the_work_of_the_layout_the_module_makes(monkeypatch):
    """The work per rank a row records on document layouts is that of the layout the module makes on
    the row's backend: weighted as flash-attn 4's varlen calls where its documents go to them."""
    from dilated import DocumentLayout
    from dilated.backends import varlen
    from dilated.bench.documents import cu_seqlens_of
    from dilated.bench.registry import Case
    from dilated.bench.strategies import RING_IMPLEMENTATIONS

    case = Case(batch=1, seq_len=1 << 18, num_heads=32, num_kv_heads=8, head_dim=128, causal=True,
                documents="lognormal:8k,1.0")
    cu = cu_seqlens_of(case.documents, case.seq_len)
    impl = RING_IMPLEMENTATIONS["documents"]
    pairs = [float(w) for w in DocumentLayout.balance(cu, 4, True).work_per_rank()]
    weighted = [float(w) for w in DocumentLayout.balance(cu, 4, True, pair_costs=(12, 11)).work_per_rank()]
    assert pairs != weighted
    assert impl.work_per_rank(case, 4, "auto") == pairs  # the host: no varlen kernel
    monkeypatch.setattr(varlen, "varlen_reason", lambda q, k, v, backend, causal=False: None)
    assert impl.work_per_rank(case, 4, "auto") == weighted
    assert impl.work_per_rank(case, 4, "sdpa_cudnn") == pairs
