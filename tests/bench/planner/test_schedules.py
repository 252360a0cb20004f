import pytest

from dilated.bench.planner.calibration import DecodePoint
from dilated.bench.planner.kernel_model import KernelModel
from dilated.bench.planner.network import InterNode, Network
from dilated.bench.planner.schedules import Model, Problem
from synthetic_calibration import calibration, decode_ms, link, true_ms, with_graph_decode


def model(links=None, gpus_per_node=8, inter=None):
    cal = calibration(links)
    return Model(KernelModel(cal), Network(cal, gpus_per_node, inter))


def free_links():
    return {name: link(latency=1e-9, per_ms=1e30) for name in ("p2p", "copy_engine", "all_to_all", "all_gather",
                                                               "reduce_scatter")}


def test_zigzag_ring_of_two_on_free_links_takes_its_slower_ranks_kernels():
    m = model(free_links())
    n = 32768
    p = m.predict("ring_zigzag", Problem(2 * n, 32, 8, 128, causal=True, mode="fwd"), 2)
    # step 0: each rank's shard causal on itself; step 1: rank 0 the later half of its queries over the
    # whole block of rank 1 (all visible), rank 1 all its queries over the first half of rank 0's
    diag = true_ms(1, n, n, 32, 128, True, "fwd")
    rank0 = diag + true_ms(1, n // 2, n, 32, 128, False, "fwd")
    rank1 = diag + true_ms(1, n, n // 2, 32, 128, False, "fwd")
    assert p.time_ms == pytest.approx(max(rank0, rank1), rel=1e-6)
    assert p.exposed_ms == pytest.approx(0.0, abs=1e-6)


def test_the_contiguous_causal_ring_waits_for_its_last_rank():
    m = model(free_links())
    n, prob = 16384, Problem(4 * 16384, 32, 8, 128, causal=True, mode="fwd")
    ring = m.predict("ring", prob, 4)
    block = true_ms(1, n, n, 32, 128, False, "fwd")
    assert ring.time_ms == pytest.approx(true_ms(1, n, n, 32, 128, True, "fwd") + 3 * block, rel=1e-6)
    assert ring.time_ms > 1.4 * m.predict("ring_zigzag", prob, 4).time_ms


def test_slow_links_the_overlapped_ring_waits_on_each_block_once():
    t = 500.0  # ms per block: far longer than any step's kernels
    m = model({name: link(latency=t, per_ms=1e30) for name in ("p2p", "copy_engine", "all_to_all", "all_gather",
                                                                  "reduce_scatter")})
    prob = Problem(4 * 8192, 16, 16, 128, causal=False, mode="fwd")
    block = true_ms(1, 8192, 8192, 16, 128, False, "fwd")
    overlapped = m.predict("ring", prob, 4)
    assert overlapped.time_ms == pytest.approx(3 * t + block, rel=1e-6)  # each pull issued a step ahead
    assert m.predict("ring_no_overlap", prob, 4).time_ms == pytest.approx(3 * t + 4 * block, rel=1e-6)
    assert overlapped.exposed_ms == pytest.approx(3 * t - 3 * block, rel=1e-6)


def test_ulysses_in_head_groups_exposes_only_the_first_groups_inputs_and_the_last_groups_output():
    # P=2, 32/8 heads: 16/4 per rank, four head groups of 4 q heads and 1 kv head
    one = model(free_links())
    c = one.single_device(Problem(65536, 4, 1, 128, causal=True, mode="fwd")).time_ms  # a group's kernels
    cb = one.single_device(Problem(65536, 4, 1, 128, causal=True, mode="fwd_bwd")).time_ms - c
    a = c / 4  # every all-to-all, whatever its size
    assert cb > 3 * a
    links = free_links()
    links["all_to_all"] = link(latency=a, per_ms=1e30)
    m = model(links)
    # forward: each group's q with its own kv group's k and v in one exchange (a), arriving at a, 2a, ..;
    # group g attends from a (g + 1) or when g - 1 is done; outputs go back after the inputs: only a + a wait
    fwd = m.predict("ulysses_head_groups_4", Problem(65536, 32, 8, 128, causal=True, mode="fwd"), 2)
    assert fwd.time_ms == pytest.approx(4 * c + 2 * a, rel=1e-6)
    assert fwd.exposed_ms == pytest.approx(2 * a, rel=1e-6)
    # backward: dout's groups arrive a apart, each group's dq, dk and dv (one exchange, a) after it
    both = m.predict("ulysses_head_groups_4", Problem(65536, 32, 8, 128, causal=True, mode="fwd_bwd"), 2)
    assert both.time_ms == pytest.approx(4 * c + 2 * a + 4 * cb + a + a, rel=1e-6)
    # all-to-alls slower than any group's kernels: the exchanges run back to back, 8 of them
    links["all_to_all"] = link(latency=10 * c, per_ms=1e30)
    assert model(links).predict("ulysses_head_groups_4", Problem(65536, 32, 8, 128, causal=True, mode="fwd"),
                                2).time_ms == pytest.approx(8 * 10 * c, rel=1e-6)


def test_ulysses_without_a_varlen_kernel_exposes_all_of_its_exchanges():
    """Bandwidth-bound links: as one group (``auto`` where documents do not run in one varlen call,
    as on this calibration) every byte of q, k, v and out waits; in four groups a quarter of q's and
    out's bytes and k, v's first quarter."""
    prob = Problem(65536, 32, 8, 128, causal=True, mode="fwd", documents="fixed:8k")
    q = 32768 * 32 * 128 * 2 / 2  # half of a rank's q (or out) leaves it, bf16
    kv = 2 * 32768 * 8 * 128 * 2 / 2
    kernels = model(free_links()).single_device(Problem(65536, 16, 4, 128, causal=True, mode="fwd",
                                                        documents="fixed:8k")).time_ms  # a rank's heads
    per_ms = (2 * q + kv) / (0.2 * kernels)  # bytes per ms: every exchange shorter than a group's kernels
    links = free_links()
    links["all_to_all"] = link(latency=0.0, per_ms=per_ms)
    m = model(links)
    for name in ("ulysses_exchange_all", "ulysses_no_overlap"):
        assert m.predict(name, prob, 2).exposed_ms == pytest.approx((2 * q + kv) / per_ms, rel=1e-3)
    assert m.predict("ulysses_head_groups_4", prob, 2).exposed_ms == pytest.approx((2 * q + kv) / 4 / per_ms, rel=1e-3)


def test_ulysses_on_documents_of_one_length_on_the_shards_boundaries_moves_nothing():
    """Ulysses (``local_documents="auto"``) and the hybrid on the documents' layout attend every
    document on its rank, all heads: each rank's four 8K documents, like the documents strategy."""
    m = model()
    prob = Problem(1 << 17, 32, 8, 128, causal=True, mode="fwd_bwd", documents="fixed:8k")
    for name, world, grid in (("ulysses", 4, None), ("hybrid_documents", 4, (2, 2))):
        p = m.predict(name, prob, world, grid)
        assert p.bytes_sent == 0.0 and p.exposed_ms == 0.0, name
        assert p.time_ms == pytest.approx(true_ms(4, 8192, 8192, 32, 128, True, "fwd_bwd"), rel=1e-6), name
    assert m.predict("ulysses_exchange_all", prob, 4).bytes_sent > 0
    assert m.predict("hybrid_documents_exchange_all", prob, 4, (2, 2)).bytes_sent > 0


def test_ulysses_attends_its_own_documents_while_the_crossing_ones_move():
    """One document across the shards' boundary, the others whole: each rank's own documents on all
    heads hide the crossing rows' inputs (a slow link: its latency shows once per exchange that no
    own documents hide; q, k and v move in one); the crossing document's attention and its output's
    exchange follow."""
    cu = (0, 4096, 8192, 12288, 16384 + 4096, 24576, 28672, 32768)  # document 3 crosses 16384
    a = 1000.0
    links = free_links()
    links["all_to_all"] = link(latency=a, per_ms=1e30)
    m = model(links)
    prob = Problem(32768, 32, 8, 128, causal=True, mode="fwd", cu=cu)
    own = true_ms(3, 4096, 4096, 32, 128, True, "fwd")  # each rank's three 4K documents
    cross = true_ms(1, 8192, 8192, 16, 128, True, "fwd")  # the crossing one on a rank's half of the heads
    p = m.predict("ulysses", prob, 2)
    assert p.time_ms == pytest.approx(max(own, a) + cross + a, rel=1e-6)
    assert p.bytes_sent > 0


def test_documents_that_stay_whole_move_nothing():
    m = model()
    p = m.predict("documents", Problem(65536, 32, 8, 128, causal=True, mode="fwd_bwd", documents="fixed:8k"), 2)
    assert p.bytes_sent == 0.0
    assert p.time_ms == pytest.approx(true_ms(4, 8192, 8192, 32, 128, True, "fwd_bwd"), rel=1e-6)


def test_crossing_documents_wait_for_their_rows_when_the_gather_is_slower_than_the_local_documents():
    links = free_links()
    links["all_gather"] = link(latency=400.0, per_ms=1e30)
    p = model(links).predict("documents", Problem(65536, 32, 8, 128, causal=True, mode="fwd"), 2)  # one document
    assert p.bytes_sent > 0
    assert p.time_ms > 400.0 and p.exposed_ms > 0


def test_decode_reads_the_calibrated_steps_of_its_rows_per_rank():
    m = model()
    row = 8 * 128 * 2 * 2  # k and v bytes of one cached row, llama3-8b heads
    one = m.predict("decode", Problem(1 << 17, 32, 8, 128, mode="decode"), 1)
    two = m.predict("decode", Problem(1 << 18, 32, 8, 128, mode="decode"), 2)
    assert one.time_ms == pytest.approx(decode_ms(1, (1 << 17) * row), rel=1e-9)
    assert two.time_ms == pytest.approx(decode_ms(2, (1 << 17) * row), rel=1e-9)


def test_decode_reads_the_steps_timed_on_as_many_ranks():
    """A step on more ranks waits for more of them: a calibration with steps on 1, 2 and 4 ranks gives P=2
    the 2-rank steps and P=4 the 4-rank ones (each with its rows per rank)."""
    cal = calibration()
    cal.decode = cal.decode + [DecodePoint(4, b, s, 32, 8, 128, decode_ms(2, b * s * 8 * 128 * 4) + 0.5)
                               for b in (1, 8) for s in (1 << 14, 1 << 17, 1 << 19)]
    m = Model(KernelModel(cal), Network(cal, 4, None))
    row = 8 * 128 * 2 * 2
    two = m.predict("decode", Problem(1 << 18, 32, 8, 128, mode="decode"), 2)
    four = m.predict("decode", Problem(1 << 19, 32, 8, 128, mode="decode"), 4)
    assert two.time_ms == pytest.approx(decode_ms(2, (1 << 17) * row), rel=1e-9)
    assert four.time_ms == pytest.approx(decode_ms(2, (1 << 17) * row) + 0.5, rel=1e-9)


def test_decode_replayed_from_cuda_graphs_reads_the_steps_timed_so():
    """Steps called from Python hold the host's launches, replays of a CUDA graph do not: a problem run one
    way reads the steps timed that way, and says to calibrate again where there are none."""
    cal = with_graph_decode(calibration())
    row = 8 * 128 * 2 * 2
    m = Model(KernelModel(cal), Network(cal, 2, None))
    eager = m.predict("decode", Problem(1 << 18, 32, 8, 128, mode="decode"), 2)
    graph = m.predict("decode", Problem(1 << 18, 32, 8, 128, mode="decode", cuda_graph=True), 2)
    assert eager.time_ms == pytest.approx(decode_ms(2, (1 << 17) * row), rel=1e-9)
    assert graph.time_ms == pytest.approx(decode_ms(2, (1 << 17) * row) / 4, rel=1e-9)
    cal.decode = [d for d in cal.decode if not d.cuda_graph]
    none = Model(KernelModel(cal), Network(cal, 2, None)).predict(
        "decode", Problem(1 << 18, 32, 8, 128, mode="decode", cuda_graph=True), 2)
    assert not none.supported and "CUDA graphs" in none.reason and "calibrate again" in none.reason


@pytest.mark.parametrize("strategy, world, grid, words", [
    ("ulysses", 3, None, "not divisible"),
    ("hybrid", 4, None, "grid"),
    ("hybrid", 4, (3, 1), "grid"),
    ("torch_cp", 2, None, "not modelled"),
    ("decode", 2, None, "decode only"),
])
def test_what_cannot_run_says_why(strategy, world, grid, words):
    p = model().predict(strategy, Problem(3 * 65536, 32, 8, 128), world, grid)
    assert not p.supported and words in p.reason


def test_across_nodes_the_link_between_them_is_needed_and_used():
    prob = Problem(16 * 65536, 32, 8, 128, causal=True, mode="fwd_bwd")
    without = model(gpus_per_node=8).predict("ring_zigzag", prob, 16)
    assert not without.supported and "--inter-node-gbs" in without.reason
    slow = model(gpus_per_node=8, inter=InterNode(1.0)).predict("ring_zigzag", prob, 16)
    fast = model(gpus_per_node=8, inter=InterNode(1000.0)).predict("ring_zigzag", prob, 16)
    assert slow.time_ms > fast.time_ms and slow.exposed_ms > fast.exposed_ms


def test_a_collective_across_nodes_pays_the_latency_between_them_at_every_ring_step():
    """NCCL's all-gather and reduce-scatter are rings of P - 1 steps: across nodes each step waits for the
    link's latency, so a decode step's small all-gather over 64 ranks costs 63 latencies, and splitting a
    small cache over 8 nodes loses to splitting it within one."""
    net = Network(calibration(), 8, InterNode(50.0, latency_us=10.0))
    sixty_four, two_nodes = list(range(64)), [0, 8]
    assert net.all_gather_ms(16e3, sixty_four) == pytest.approx(63 * 0.01 + 63 * 16e3 / 50e9 * 1e3)
    assert net.reduce_scatter_ms(64 * 16e3, sixty_four) == pytest.approx(63 * 0.01 + 63 * 16e3 / 50e9 * 1e3)
    assert net.all_gather_ms(16e3, two_nodes) == pytest.approx(0.01 + 16e3 / 50e9 * 1e3)
    big = 1 << 30  # large messages: the bandwidth's term, as before
    assert net.all_gather_ms(big, sixty_four) == pytest.approx(63 * big / 50e9 * 1e3, rel=1e-3)
    m = model(gpus_per_node=8, inter=InterNode(50.0, latency_us=10.0))
    prob = Problem(1 << 20, 32, 8, 128, mode="decode")
    assert m.predict("decode", prob, 64).time_ms > m.predict("decode", prob, 8).time_ms


def test_a_prediction_says_where_it_extrapolates_below_the_calibrated_work():
    m = model()
    few = m.predict("ulysses", Problem(8 * 2048, 32, 8, 128, causal=True, mode="fwd"), 8)  # 4 heads of 16K rows
    assert few.notes and "extrapolated" in few.notes[0]
    assert not m.predict("ring_zigzag", Problem(2 * 65536, 32, 8, 128, causal=True, mode="fwd"), 2).notes


def test_the_note_names_the_head_shapes_a_calibration_lacks(monkeypatch):
    """Ulysses on 8 ranks runs 4 of Llama-3-8B's 32 q heads (and 1 of its 8 kv heads) per rank: a calibration
    without that shape extrapolates those calls, and the note says which shape to calibrate; one with it
    names none."""
    import synthetic_calibration

    prob = Problem(8 * 2048, 32, 8, 128, causal=True, mode="fwd")
    lacking = model().predict("ulysses", prob, 8)
    assert "--head-shapes 4/1/128" in lacking.notes[0]
    monkeypatch.setattr(synthetic_calibration, "SHAPES", synthetic_calibration.SHAPES + [(4, 1, 128)])
    cal = synthetic_calibration.calibration()
    having = Model(KernelModel(cal), Network(cal, 8, None)).predict("ulysses", prob, 8)
    assert not any("--head-shapes" in n for n in having.notes)


def test_links_between_nodes_can_be_a_calibration_measured_across_nodes():
    slow = {name: link(latency=50.0 if name == "p2p" else 70.0, per_ms=1e30)
            for name in ("p2p", "all_to_all", "all_gather", "reduce_scatter")}
    across = calibration(slow, nodes=2)
    net = Network(calibration(), 8, InterNode.measured(across, "across.json"))
    assert net.p2p_ms(1e6, [0, 8]) == pytest.approx(50.0)  # a hop between nodes: the measured send/recv
    assert net.all_to_all_ms(1e6, list(range(16))) == pytest.approx(70.0)  # its bytes leaving the node
    assert net.p2p_ms(1e6, [0, 1]) < 1.0  # within a node: the node's own links
    with pytest.raises(ValueError, match="within one node.*two or more nodes"):
        InterNode.measured(calibration(), "one-node.json")


def test_memory_counts_the_rows_of_the_largest_batched_documents_call():
    """Four documents of 8K in one batched call gather their q, k, v and out (backward: also dout,
    dq, dk, dv) at once: that much above the same rows as one sequence; 8K and 4K documents: the 8K
    call's rows."""
    m = model()
    n, h, hkv, d = 32768, 32, 8, 128
    dense = m.single_device(Problem(n, h, hkv, d, causal=True, mode="fwd_bwd")).memory_gib
    four = m.single_device(Problem(n, h, hkv, d, causal=True, mode="fwd_bwd", documents="fixed:8k")).memory_gib
    assert (four - dense) * 2**30 == pytest.approx(n * 4 * (h + hkv) * d * 2, rel=1e-9)
    fwd = m.single_device(Problem(n, h, hkv, d, causal=True, mode="fwd", documents="fixed:8k")).memory_gib
    assert (fwd - m.single_device(Problem(n, h, hkv, d, causal=True, mode="fwd")).memory_gib) * 2**30 == \
        pytest.approx(n * 2 * (h + hkv) * d * 2, rel=1e-9)


def _with(kernels_slowest=None, strategies=()):
    """``model()``'s calibration with each kernel point's slowest rank at ``kernels_slowest`` x its mean
    and the timed strategy calls ``strategies``."""
    import dataclasses

    cal = calibration(free_links())
    if kernels_slowest is not None:
        cal.kernels = [dataclasses.replace(p, slowest_ms=p.ms * kernels_slowest) for p in cal.kernels]
    cal.strategies = list(strategies)
    return Model(KernelModel(cal), Network(cal, 8, None))


def test_several_ranks_run_their_kernels_at_the_slowest_gpus_pace():
    prob = Problem(2 * 32768, 32, 8, 128, causal=True, mode="fwd_bwd")
    even, slow = _with(), _with(kernels_slowest=1.07)
    assert slow.kernels.calibration.slowest_rank_pace() == pytest.approx(1.07)
    for name in ("ring_zigzag", "ulysses", "documents"):  # free links: all of it is kernels
        assert slow.predict(name, prob, 2).time_ms == pytest.approx(1.07 * even.predict(name, prob, 2).time_ms,
                                                                    rel=1e-6)
    # one GPU alone runs at its own (the mean) pace, also after a distributed prediction
    assert slow.single_device(prob).time_ms == pytest.approx(even.single_device(prob).time_ms, rel=1e-9)
    assert _with(kernels_slowest=None).kernels.calibration.slowest_rank_pace() == 1.0


def test_a_strategys_timed_call_slower_than_the_model_is_a_floor_under_larger_calls_of_its_kind():
    """A timed call slower than its model (the host's pace) bounds from below the predictions of its
    strategy and the variants measured as it on calls of its kind (mode, causal, documents or not,
    ranks) with at least its work per rank; it adds nothing where the model is above it, and bounds
    nothing of another kind, smaller, or where the timed call was faster than modelled."""
    import dataclasses

    from dilated.bench.planner.calibration import StrategyPoint

    base = _with(kernels_slowest=1.05)
    small = Problem(2 * 16384, 32, 8, 128, causal=True, mode="fwd_bwd", documents="lognormal:8k,1.0")
    timed = {s: base.predict(s, small, 2).time_ms for s in ("documents", "ulysses")}
    slow = 20 * timed["documents"]  # the host's pace: twenty times the kernels'
    points = [StrategyPoint("documents", 2, "fwd_bwd", small.seq_len, 32, 8, 128, True, small.documents, slow),
              StrategyPoint("ulysses", 2, "fwd_bwd", small.seq_len, 32, 8, 128, True, small.documents,
                            0.9 * timed["ulysses"])]
    m = _with(kernels_slowest=1.05, strategies=points)
    assert m.predict("documents", small, 2).time_ms == pytest.approx(slow)
    twice = Problem(2 * 32768, 32, 8, 128, causal=True, mode="fwd_bwd", documents="lognormal:1k,1.0")
    assert base.predict("documents", twice, 2).time_ms < slow
    assert m.predict("documents", twice, 2).time_ms == pytest.approx(slow)
    assert m.predict("documents", twice, 2).floor_ms == pytest.approx(slow)
    big = Problem(2 * 1048576, 32, 8, 128, causal=True, mode="fwd_bwd", documents="lognormal:8k,1.0")
    assert base.predict("documents", big, 2).time_ms > slow
    for name, p in (("documents", big), ("ulysses", twice), ("ulysses_head_groups_2", twice),
                    ("ring_documents", twice),  # timed calls of other strategies only
                    ("documents", Problem(2 * 8192, 32, 8, 128, causal=True, mode="fwd_bwd",  # smaller
                                          documents="lognormal:8k,1.0")),
                    ("documents", Problem(2 * 16384, 32, 8, 128, causal=True, mode="fwd_bwd")),  # not documents
                    ("documents", Problem(2 * 32768, 32, 8, 128, causal=True, mode="fwd",  # another mode
                                          documents="lognormal:8k,1.0"))):
        before, after = base.predict(name, p, 2), m.predict(name, p, 2)
        assert after.time_ms == pytest.approx(before.time_ms, rel=1e-9), (name, p)
        assert after.exposed_ms == pytest.approx(before.exposed_ms, rel=1e-9)  # not communication
    wider = Problem(4 * 32768, 32, 8, 128, causal=True, mode="fwd_bwd", documents="lognormal:1k,1.0")
    assert m.predict("documents", wider, 4).time_ms == pytest.approx(slow)  # more ranks: more host work
    on_four = _with(kernels_slowest=1.05, strategies=[dataclasses.replace(points[0], ranks=4)])
    assert on_four.predict("documents", twice, 2).time_ms == pytest.approx(base.predict("documents", twice, 2).time_ms)
    assert m.single_device(big).time_ms == pytest.approx(base.single_device(big).time_ms)


def test_ulysses_by_groups_of_documents_attends_each_group_on_all_of_a_ranks_heads():
    from dilated.bench.documents import cu_seqlens_of
    from dilated.parallel.document_groups import document_groups_for

    spec, n = "lognormal:8k,1.0", 1 << 18
    cu = cu_seqlens_of(spec, n)
    groups = document_groups_for(list(cu))
    assert len(groups) == 3
    free = model(free_links())
    groups_cu = []
    for docs in groups:
        lengths = [cu[d + 1] - cu[d] for d in sorted(docs)]
        groups_cu.append([0, *__import__("itertools").accumulate(lengths)])
    want = sum(free.kernels.documents_ms(c, 1, 8, 2, 128, True, "fwd") for c in groups_cu)
    p = free.predict("ulysses_document_groups", Problem(n, 32, 8, 128, causal=True, mode="fwd", documents=spec), 4)
    assert p.time_ms == pytest.approx(want, rel=1e-6) and p.exposed_ms == pytest.approx(0.0, abs=1e-6)
    # exchanges far slower than the kernels: each group's input (q, k, v at once) and its output, one after another
    t = 1000.0
    slow = model({name: link(latency=t, per_ms=1e30) for name in ("p2p", "copy_engine", "all_to_all", "all_gather",
                                                                  "reduce_scatter")})
    fwd = slow.predict("ulysses_document_groups", Problem(n, 32, 8, 128, causal=True, mode="fwd", documents=spec), 4)
    assert fwd.time_ms == pytest.approx(2 * len(groups) * t, rel=1e-9)
    # one sequence: one group (as Ulysses with one head group)
    dense = Problem(n, 32, 8, 128, causal=True, mode="fwd_bwd")
    assert slow.predict("ulysses_document_groups", dense, 4).time_ms == pytest.approx(
        slow.predict("ulysses_no_overlap", dense, 4).time_ms, rel=1e-9)


def test_the_hybrids_row_exchange_by_documents_hides_the_whole_documents_behind_the_ring():
    """``hybrid_documents_row_groups`` on a 2 x 2 grid: on free links, each row's ring over the crossing
    documents' own layout plus its whole documents on the row's heads (the slowest row), nothing
    exposed; on a slow all-to-all, forward and backward, less exposed than the row's one exchange, the
    same bytes; with no whole document in a row (one document), as one exchange."""
    from dilated.parallel.document_layout import DocumentLayout
    from dilated.parallel.row_documents import crossing_layout, pipelines, row_groups

    # 4K documents and a 16K one: whole documents cannot balance the rows, the 16K one is cut head-tail
    cu = (0, *range(4096, 6 * 4096 + 1, 4096), *range(6 * 4096 + 16384, 65537, 4096))
    prob = Problem(65536, 32, 8, 128, causal=True, mode="fwd", cu=cu)
    layout = DocumentLayout.balance(cu, 2, True)
    assert pipelines(layout)
    m = model(free_links())
    ring = m._documents(prob, [0, 2], 16, 4, "ring", crossing_layout(layout)).time
    whole = []
    for j in range(2):  # every whole document is 4K: batched calls of power-of-two counts (6: 4 and 2)
        row_cu, (_, docs) = row_groups(layout, j)
        assert {row_cu[i + 1] - row_cu[i] for i in docs} == {4096} and len(docs) == 6
        whole.append(true_ms(4, 4096, 4096, 16, 128, True, "fwd") + true_ms(2, 4096, 4096, 16, 128, True, "fwd"))
    p = m.predict("hybrid_documents_row_groups", prob, 4, (2, 2))
    assert p.time_ms == pytest.approx(ring + max(whole), rel=1e-6) and p.exposed_ms == pytest.approx(0.0, abs=1e-6)
    links = free_links()
    links["all_to_all"] = link(latency=1e-9, per_ms=2e7)  # 20 GB/s: the exchanges cost milliseconds
    slow = model(links)
    both = Problem(65536, 32, 8, 128, causal=True, mode="fwd_bwd", cu=cu)
    grouped = slow.predict("hybrid_documents_row_groups", both, 4, (2, 2))
    at_once = slow.predict("hybrid_documents_exchange_all", both, 4, (2, 2))
    assert grouped.exposed_ms < 0.8 * at_once.exposed_ms and grouped.bytes_sent == pytest.approx(at_once.bytes_sent)
    one = Problem(65536, 32, 8, 128, causal=True, mode="fwd", cu=(0, 65536))
    assert slow.predict("hybrid_documents_row_groups", one, 4, (2, 2)).time_ms == pytest.approx(
        slow.predict("hybrid_documents_exchange_all", one, 4, (2, 2)).time_ms, rel=1e-9)


def test_the_hybrids_row_exchange_keeping_local_documents_attends_them_beside_the_ring():
    """``hybrid_documents_row_groups_local`` on a 2 x 2 grid: every rank keeps three 4K documents of
    its row (all 32 heads: batched calls of 2 and 1) and exchanges only the crossing document's pieces
    for the ring; on free links, its own documents then the ring; on a slow all-to-all, fewer bytes and
    less exposed than the row exchange that moves every document."""
    from dilated.parallel.document_layout import DocumentLayout
    from dilated.parallel.row_documents import crossing_layout, row_plans

    cu = (0, *range(4096, 6 * 4096 + 1, 4096), *range(6 * 4096 + 16384, 65537, 4096))  # 4K documents, one 16K
    prob = Problem(65536, 32, 8, 128, causal=True, mode="fwd", cu=cu)
    layout = DocumentLayout.balance(cu, 2, True)
    for j in range(2):
        plan = row_plans(layout, 2, "auto")[j]
        assert plan.rings == (True,) and all(len(s) == 3 and {m for _, m in s} == {4096} for s in plan.local.spans)
    m = model(free_links())
    ring = m._documents(prob, [0, 2], 16, 4, "ring", crossing_layout(layout)).time
    own = true_ms(2, 4096, 4096, 32, 128, True, "fwd") + true_ms(1, 4096, 4096, 32, 128, True, "fwd")
    p = m.predict("hybrid_documents_row_groups_local", prob, 4, (2, 2))
    assert p.time_ms == pytest.approx(own + ring, rel=1e-6)
    links = free_links()
    links["all_to_all"] = link(latency=1e-9, per_ms=2e7)
    slow = model(links)
    both = Problem(65536, 32, 8, 128, causal=True, mode="fwd_bwd", cu=cu)
    local = slow.predict("hybrid_documents_row_groups_local", both, 4, (2, 2))
    every = slow.predict("hybrid_documents_row_groups", both, 4, (2, 2))
    assert local.bytes_sent < 0.6 * every.bytes_sent and local.exposed_ms < every.exposed_ms


def test_documents_kept_where_they_lie_hold_their_rows_taken_out_and_their_gradients():
    """A rank's local documents hold, per row (b=1, 4 heads, 2 kv heads, D=8, bf16): their output
    (64 bytes), and where their rows are not one run their q, k, v copies (128); backward also the
    q, k, v gradients (128) and, not one run, the output gradient's rows (64)."""
    from dilated.bench.planner.schedules import _local_bytes
    from dilated.parallel.local_documents import contiguous_ranges, local_documents

    cu = [0, 4, 8, 12, 16, 20, 32]  # rank 0: documents 0, 2 and 3 kept, 1 between them exchanged
    kept = local_documents("always", cu, contiguous_ranges(32, 2), True, exchanged=[1])
    assert kept.spans == (((0, 4), (8, 4), (12, 4)), ((0, 4), (4, 12)))
    assert _local_bytes(kept, 0, 1, 4, 2, 8, "fwd") == 12 * (128 + 64)
    assert _local_bytes(kept, 0, 1, 4, 2, 8, "fwd_bwd") == 12 * (128 + 64 + 64 + 128)
    assert _local_bytes(kept, 1, 1, 4, 2, 8, "fwd") == 16 * 64  # one run: views, no copies
    assert _local_bytes(kept, 1, 1, 4, 2, 8, "fwd_bwd") == 16 * (64 + 128)


def test_the_ring_on_the_head_tail_layout_attends_every_documents_pieces_and_relays_all_their_rows():
    """``ring_head_tail`` (DocumentLayout.head_tail, P=2): on free links, the slowest rank's own pieces
    (each document's head and tail with themselves) and its rectangles over the other rank's pieces;
    every document crosses, so every row goes round the ring, where ``ring_documents`` keeps the four
    documents whole, two on each rank, and relays none."""
    from dilated.parallel.document_attention import rank_plan
    from dilated.parallel.document_layout import DocumentLayout

    cu = (0, 8192, 16384, 24576, 32768)
    prob = Problem(32768, 32, 8, 128, causal=True, mode="fwd", cu=cu)
    m = model(free_links())
    layout = DocumentLayout.head_tail(cu, 2, True)
    km = m.kernels
    by_hand = max(km.documents_ms(rank_plan(layout, r).local_cu, 1, 32, 8, 128, True, "fwd")
                  + km.rectangles_ms(rank_plan(layout, r).cu_q, rank_plan(layout, r).cu_k, 1, 32, 8, 128, "fwd")
                  for r in range(2))
    p = m.predict("ring_head_tail", prob, 2)
    assert p.time_ms == pytest.approx(max(by_hand, p.floor_ms), rel=1e-6)
    assert rank_plan(layout, 0).rows == 16384  # every row of the rank's pieces
    assert p.bytes_sent == 16384 * 8 * 2 * 128 * 2 and m.predict("ring_documents", prob, 2).bytes_sent == 0


def test_the_rectangles_of_crossing_documents_hold_their_rows_taken_out():
    """One causal document of 8K rows cut head-tail over 2 ranks: rank 1 holds its pieces 1 and 2
    (4096 query rows), piece 1 over piece 0's 2048 keys, piece 2 over pieces 0 and 1 (6144 key rows
    in all). Forward (bf16, 32 heads, 8 kv heads, D=128): the query rows taken out and their output
    (2 x 4096 x 32 x 128 x 2 bytes), their float32 lse (4096 x 32 x 4) and the key and value rows
    (6144 x 8 x 256 x 2); backward also dout, q and out's rows, the gradients, a float32 dq."""
    from dilated.bench.planner.schedules import _crossing_bytes
    from dilated.parallel.document_attention import rank_plan
    from dilated.parallel.document_layout import DocumentLayout

    plan = rank_plan(DocumentLayout.balance((0, 8192), 2, True), 1)
    assert (plan.cu_q[-1], plan.cu_k[-1]) == (4096, 6144)
    fwd = 2 * 4096 * 32 * 128 * 2 + 4096 * 32 * 4 + 6144 * 8 * 256 * 2
    assert _crossing_bytes(4096, 6144, 1, 32, 8, 128, "fwd") == fwd
    bwd = 4096 * 32 * 128 * (4 * 2 + 4) + 4096 * 32 * 4 + 2 * 6144 * 8 * 256 * 2
    assert _crossing_bytes(4096, 6144, 1, 32, 8, 128, "fwd_bwd") == bwd


def test_own_documents_not_in_one_run_pay_for_their_rows_taken_out_and_put_back():
    """A rank whose own documents are one run of its shard attends them in place; one whose own
    documents are split by a document that moves pays the documents path's cost per element of
    gathers and scatters on their rows (here stood in by 1 ms per row). Beside an exchange they
    attend in two parts of equal work: rank 0's are the runs either side of the moved document, each
    in place."""
    from dilated.bench.planner.schedules import _own_documents_ms
    from dilated.parallel.local_documents import contiguous_ranges, local_documents

    cu = [0, 4, 8, 40, 44, 48, *range(49, 97)]  # rank 0: 4 + 4, a long one exchanged, 4 + 4; rank 1: one run
    kept = local_documents("auto", cu, contiguous_ranges(96, 2), True)
    assert kept.exchanged == (2,)
    km = KernelModel(calibration())
    km.documents_extra_ms = lambda calls, rows, *rest: calls * 1000.0 + rows * 1.0
    for rank, rows, extra in ((0, 16, 16.0), (1, 48, 0.0)):
        bare = km.documents_ms(kept.local_cu(rank), 1, 32, 8, 128, True, "fwd")
        assert kept.local_cu(rank)[-1] == rows
        whole = _own_documents_ms(km, kept, rank, 1, 32, 8, 128, True, "fwd", parts=False)
        assert whole == [pytest.approx(bare + extra)]
        halves = [km.documents_ms(cu_part, 1, 32, 8, 128, True, "fwd") for cu_part in
                  ([(0, 4, 8)] * 2 if rank == 0 else [tuple(range(0, 25)), tuple(range(0, 25))])]
        assert _own_documents_ms(km, kept, rank, 1, 32, 8, 128, True, "fwd") == pytest.approx(halves)


def test_the_hybrids_defaults_follow_the_modules_choice_of_row_exchange():
    """``hybrid_documents`` (``document_groups="auto"``) is planned as the module runs it: where no row
    keeps documents of its own but every row holds crossing pieces and whole documents (256K of
    lognormal:8k on 2 x 2), by documents, as ``hybrid_documents_row_groups_local``, on one node, and
    in one exchange where the ring's two rows are on two nodes; where rows keep documents (4K
    documents beside a 12K one), one exchange beside them, as ``hybrid_documents_one_exchange``."""
    from dilated.parallel.document_layout import DocumentLayout
    from dilated.parallel.row_documents import pipelines, plans_for, row_plans

    links = free_links()
    links["all_to_all"] = link(latency=1e-9, per_ms=2e7)  # exchanges of milliseconds: the plans part
    m = model(links)
    lognormal = Problem(262144, 32, 8, 128, causal=True, mode="fwd_bwd", documents="lognormal:8k,1.0")
    layout = DocumentLayout.balance(lognormal.cu_seqlens(), 2, True)
    assert plans_for(layout, 2, "auto", 1) is None and pipelines(layout)
    auto, by_documents, once = (m.predict(s, lognormal, 4, (2, 2)) for s in (
        "hybrid_documents", "hybrid_documents_row_groups_local", "hybrid_documents_one_exchange"))
    assert auto.time_ms == pytest.approx(by_documents.time_ms, rel=1e-9)
    assert auto.exposed_ms < once.exposed_ms
    two_nodes = model(links, gpus_per_node=2, inter=InterNode(50.0))  # each column's two rows on two nodes
    assert two_nodes.predict("hybrid_documents", lognormal, 4, (2, 2)).time_ms == pytest.approx(
        two_nodes.predict("hybrid_documents_one_exchange", lognormal, 4, (2, 2)).time_ms, rel=1e-9)
    cu = (0, *range(4096, 7 * 4096 + 1, 4096), *range(7 * 4096 + 12288, 65537, 4096))
    kept = Problem(65536, 32, 8, 128, causal=True, mode="fwd_bwd", cu=cu)
    assert all(plan.local is not None for plan in row_plans(DocumentLayout.balance(cu, 2, True), 2, "auto", False))
    assert m.predict("hybrid_documents", kept, 4, (2, 2)).time_ms == pytest.approx(
        m.predict("hybrid_documents_one_exchange", kept, 4, (2, 2)).time_ms, rel=1e-9)


def test_a_ring_pulled_by_the_copy_engines_holds_its_published_shard_too():
    problem = Problem(65536, 32, 8, 128, causal=True, mode="fwd")
    pulled, sent = (model().predict(s, problem, 2) for s in ("ring_zigzag", "ring_zigzag_p2p"))
    shard_kv = 32768 * 8 * 128 * 2 * 2  # a rank's rows of k and v, bf16: what it publishes
    assert (pulled.memory_gib - sent.memory_gib) * 2**30 == pytest.approx(shard_kv)
