"""DocumentLayout: every rank holds N/P positions, together every position once, and the attended
work of each rank's positions (counted position by position here, not from the layout's pieces)
is balanced on the document mixes training feeds."""
import itertools

import pytest
import torch

from dilated import DocumentLayout
from dilated.bench.documents import cu_seqlens_of


def _work_of_positions(cu, positions, causal):
    """Keys each position attends, summed: causal, its offset in its document + 1; else the length."""
    cu_t = torch.tensor(cu)
    doc = torch.bucketize(positions, cu_t[1:], right=True)
    start, end = cu_t[doc], cu_t[doc + 1]
    return int((positions - start + 1).sum()) if causal else int((end - start).sum())


def _check_partition(layout, n, p):
    seen = torch.cat([layout.positions(r) for r in range(p)])
    assert all(layout.positions(r).numel() == n // p for r in range(p))
    assert torch.equal(seen.sort().values, torch.arange(n))  # each position on exactly one rank
    for r in range(p):  # a rank holds its positions in sequence order
        pos = layout.positions(r)
        assert bool((pos[1:] > pos[:-1]).all())


@pytest.mark.parametrize("spec,n", [("lognormal:8k,1.0", 1 << 18), ("lognormal:8k,1.0", 1 << 20),
                                    ("lognormal:1k,1.0", 1 << 20), ("uniform:1k-64k", 1 << 18),
                                    ("uniform:1k-64k", 1 << 20), ("fixed:32k", 1 << 18)])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_every_rank_gets_n_over_p_positions_and_equal_work(spec, n, p, causal):
    cu = cu_seqlens_of(spec, n)
    layout = DocumentLayout.balance(cu, p, causal)
    _check_partition(layout, n, p)
    work = [_work_of_positions(cu, layout.positions(r), causal) for r in range(p)]
    assert work == layout.work_per_rank()
    assert max(work) / (sum(work) / p) <= 1.02, work


def _cost_of_positions(cu, layout, rank, costs):
    """Rank ``rank``'s positions' keys weighted ``costs = (triangle, rectangle)``, summed position by
    position: the keys of its piece up to it (a causal call) at the triangle's weight, its document's
    keys before the piece (a rectangle) at the rectangle's. Only where the pieces start is the layout's."""
    cu_t = torch.tensor(cu)
    positions = layout.positions(rank)
    doc = torch.bucketize(positions, cu_t[1:], right=True)
    piece_start = torch.cat([torch.full((x.length,), x.start) for x in layout.pieces_of(rank)])
    triangle, rectangle = positions - piece_start + 1, piece_start - cu_t[doc]
    return int((costs[0] * triangle + costs[1] * rectangle).sum())


@pytest.mark.parametrize("spec,n", [("lognormal:8k,1.0", 1 << 18), ("lognormal:8k,1.0", 1 << 20),
                                    ("lognormal:1k,1.0", 1 << 20), ("uniform:1k-64k", 1 << 20)])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_causal_layouts_balance_pairs_weighted_by_their_cost(spec, n, p):
    """Causal, the layout balances each rank's pairs weighted (triangle, rectangle): counted position by
    position here, the weighted cost of every rank is within 2% of the mean, and the pairs themselves
    within 5%."""
    cu = cu_seqlens_of(spec, n)
    layout = DocumentLayout.balance(cu, p, causal=True, pair_costs=(12, 11))
    assert layout.pair_costs == (12, 11)
    cost = [_cost_of_positions(cu, layout, r, layout.pair_costs) for r in range(p)]
    assert cost == layout.cost_per_rank()
    assert max(cost) / (sum(cost) / p) <= 1.02, cost
    assert layout.imbalance() <= 1.05


def test_a_rank_of_whole_documents_gets_fewer_pairs_where_causal_pairs_cost_more():
    """On a mix where one rank holds whole documents (all its pairs causal) and the others pieces of
    cut ones (a share of rectangles), balancing pairs leaves that rank's weighted cost above the others';
    weighting them evens it out, that rank then holding fewer pairs. Equal weights balance the pairs."""
    cu = cu_seqlens_of("lognormal:8k,1.0", 1 << 18)
    costs = (12, 11)
    by_pairs = DocumentLayout.balance(cu, 4, causal=True, pair_costs=(1, 1))
    weighted = DocumentLayout.balance(cu, 4, causal=True, pair_costs=costs)

    def spread(layout):
        cost = [_cost_of_positions(cu, layout, r, costs) for r in range(4)]
        return max(cost) / (sum(cost) / 4)

    assert by_pairs.imbalance() <= 1.001 and spread(by_pairs) > 1.015
    assert spread(weighted) < 1.005 and weighted.imbalance() > 1.005
    heavy = max(range(4), key=lambda r: _cost_of_positions(cu, by_pairs, r, costs))
    pairs = weighted.work_per_rank()
    assert pairs[heavy] == min(pairs)


def test_non_causal_layouts_take_no_weights_and_pairs_are_the_default():
    cu = cu_seqlens_of("lognormal:8k,1.0", 1 << 18)
    assert DocumentLayout.balance(cu, 4, causal=False, pair_costs=(12, 11)).pair_costs == (1, 1)
    assert DocumentLayout.balance(cu, 4, causal=False, pair_costs=(12, 11)).pieces == DocumentLayout.balance(
        cu, 4, causal=False).pieces
    assert DocumentLayout.balance(cu, 4, causal=True).pair_costs == (1, 1)


def test_modules_weigh_pairs_as_the_varlen_kernel_of_their_documents(monkeypatch):
    """The layout a module makes from cu_seqlens alone weighs pairs as the kernel its documents go to:
    flash-attn 4's varlen weights where it runs (auto and flash_attn_4), pairs as they are elsewhere
    (on the host here; with another backend)."""
    from dilated.backends import varlen
    from dilated.parallel.document_attention import balanced_layout

    cu = cu_seqlens_of("lognormal:8k,1.0", 1 << 18)
    assert varlen.documents_pair_costs("auto") == (1, 1)  # no GPU: no varlen kernel
    monkeypatch.setattr(varlen, "varlen_reason", lambda q, k, v, backend, causal=False: None)
    assert varlen.documents_pair_costs("auto") == varlen.documents_pair_costs("flash_attn_4") == (12, 11)
    assert varlen.documents_pair_costs("sdpa_cudnn") == (1, 1)
    assert varlen.varlen_pair_costs("flash_attn_4_varlen") == (12, 11)
    assert varlen.varlen_pair_costs("torch_varlen") == varlen.varlen_pair_costs(None) == (1, 1)
    assert balanced_layout(cu, 4, True, "auto").pieces == DocumentLayout.balance(cu, 4, True, pair_costs=(12, 11)).pieces
    assert balanced_layout(cu, 4, True, "sdpa_cudnn").pieces == DocumentLayout.balance(cu, 4, True).pieces
    assert balanced_layout(cu, 4, False, "auto").pair_costs == (1, 1)


def test_documents_stay_whole_where_whole_documents_balance():
    cu = cu_seqlens_of("fixed:32k", 1 << 18)  # 8 documents, 2 per rank at P=4
    layout = DocumentLayout.balance(cu, 4, causal=True)
    assert layout.crossing() == frozenset() and layout.imbalance() == 1.0


def test_one_long_document_is_cut_head_tail_over_every_rank():
    n, p = 4096, 4
    layout = DocumentLayout.balance([0, n], p, causal=True)
    chunk = n // (2 * p)
    for r in range(p):  # rank r: chunks r and 2P-1-r, as zigzag cuts one sequence
        want = torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                          torch.arange((2 * p - 1 - r) * chunk, (2 * p - r) * chunk)])
        assert torch.equal(layout.positions(r), want)
    work = [_work_of_positions([0, n], layout.positions(r), True) for r in range(p)]
    assert len(set(work)) == 1


def test_short_documents_are_never_cut_into_tiny_pieces():
    cu = list(range(0, 1 << 16, 1000)) + [1 << 16]  # 1000-long documents: below 2P x 128 at P=4
    layout = DocumentLayout.balance(cu, 4, causal=True)
    assert all(x.length >= 128 or x.doc in layout.crossing() and x.length < 1000
               for m in layout.pieces for x in m)
    assert len(layout.crossing()) <= 3  # only where a rank's room ends inside a document
    _check_partition(layout, 1 << 16, 4)



@pytest.mark.parametrize("causal", [True, False])
def test_a_short_document_that_outweighs_the_rest_is_cut_into_smaller_pieces(causal):
    """A document too short for pieces of ``MIN_PIECE`` (below 2P x 128) that holds most of the work
    is cut head-tail into smaller pieces rather than left whole on one rank."""
    from dilated.parallel import document_layout as dl

    p = 4
    cu = [0, 1000] + list(range(1008, 4097, 8))  # 1000 positions (a rank holds 1024), then 8-long documents
    layout = DocumentLayout.balance(cu, p, causal)
    _check_partition(layout, 4096, p)
    assert {r for r, mine in enumerate(layout.pieces) for x in mine if x.doc == 0} == set(range(p))
    assert layout.imbalance() <= dl.ACCEPTABLE_IMBALANCE, layout.work_per_rank()


@pytest.mark.parametrize("cu,causal", [
    ([0, 26, 2249, 3341, 4706, 7331, 10133, 12256, 14104], False),
    ([0, 35, 276, 1429, 4127, 4254, 6009, 8543, 11488, 13971, 14830, 17824], True),
    ([0, 950, 2765, 4935, 6666, 7950, 10898, 10969, 13368], True),
    ([0, 2047, 3317, 6289, 7252, 9780, 12719, 15696], True),
])
def test_documents_no_rank_has_room_for_go_to_the_least_loaded_ranks_first(cu, causal):
    """Few documents over eight ranks: those left without a rank with room for them whole are cut at
    the ranks' remaining room, least loaded first, which keeps the ranks within the target."""
    from dilated.parallel import document_layout as dl

    layout = DocumentLayout.balance(cu, 8, causal)
    _check_partition(layout, cu[-1], 8)
    work = [_work_of_positions(cu, layout.positions(r), causal) for r in range(8)]
    assert max(work) / (sum(work) / 8) <= dl.TARGET_IMBALANCE, work

def test_layout_order_and_a_tensor_cu_seqlens():
    cu = torch.tensor([0, 100, 356, 1024], dtype=torch.int32)
    layout = DocumentLayout.balance(cu, 2, causal=False, min_piece=8)
    order = layout.order()
    assert torch.equal(order.sort().values, torch.arange(1024))
    assert torch.equal(order[:512], layout.positions(0)) and torch.equal(order[512:], layout.positions(1))


@pytest.mark.parametrize("cu,p,kw,match", [
    ([0, 10, 10, 16], 2, {}, "rise strictly"),
    ([1, 16], 2, {}, "rise strictly"),
    ([0, 15], 2, {}, "divisible by world_size 2"),
    ([0, 16], 0, {}, "world_size must be a positive int"),
    ([0, 16], 2, {"min_piece": 0}, "min_piece must be a positive int"),
    ([0, 16], 2, {"pair_costs": (1.1, 1)}, "pair_costs must be a tuple of two positive ints"),
    ([0, 16], 2, {"pair_costs": (12, 0)}, "pair_costs must be a tuple of two positive ints"),
    (torch.tensor([0.0, 16.0]), 2, {}, "integer tensor"),
])
def test_bad_documents_name_the_argument(cu, p, kw, match):
    with pytest.raises(ValueError, match=match):
        DocumentLayout.balance(cu, p, **kw)


def test_shards_without_a_layout_before_any_call_say_how_to_get_one():
    from dilated.parallel.document_layout import given_or_last

    one, two = DocumentLayout.balance([0, 8], 2), DocumentLayout.balance([0, 4, 8], 2)
    assert given_or_last(one, two) is one and given_or_last(None, two) is two
    with pytest.raises(ValueError, match=r"pass layout=module.document_layout\(cu_seqlens\)"):
        given_or_last(None, None)


def test_a_layout_built_in_another_process_gives_the_same_shards_and_plans():
    """A layout pickles (a DataLoader worker can build it beside its batch): the copy holds the same
    positions and gives every rank the same plan of crossing rows and rectangles."""
    import pickle

    from dilated.parallel.document_attention import rank_plan

    cu = cu_seqlens_of("lognormal:8k,1.0", 1 << 18)
    layout = DocumentLayout.balance(cu, 4, True)
    size = len(pickle.dumps(layout))
    layout.positions(0), rank_plan(layout, 0)  # derived values stay behind: the pickle is the same size
    assert len(pickle.dumps(layout)) == size
    copy = pickle.loads(pickle.dumps(layout))
    assert copy is not layout and copy.pieces == layout.pieces and copy.crossing() == layout.crossing()
    for r in range(4):
        assert torch.equal(copy.positions(r), layout.positions(r))
        a, b = rank_plan(copy, r), rank_plan(layout, r)
        assert a.local_cu == b.local_cu and a.cu_q == b.cu_q and a.cu_k == b.cu_k and a.rows == b.rows
        assert torch.equal(a.k_slots, b.k_slots) and torch.equal(a.q_rows, b.q_rows)


def test_a_rank_the_layout_does_not_have_is_refused():
    from dilated.parallel.document_attention import rank_plan

    layout = DocumentLayout.balance([0, 100, 256], 2, True)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match="rank must be in"):
            layout.positions(bad)
        with pytest.raises(ValueError, match="rank must be in"):
            rank_plan(layout, bad)



def _search_in_full(cu, p, causal, min_piece):
    """The documented search with every pass run to its end: k = 0, 1, 2, 4, ... documents cut
    head-tail (causal: the first of them split again between each rank's head and tail), the first
    within the target, else the most balanced (the lowest k among equals)."""
    from dilated.parallel import document_layout as dl

    docs = dl._documents(tuple(cu), causal)
    cuttable = [d for m, _, d in docs.in_order if m >= 2 * p * min_piece] if p > 1 else []
    ks = [0]
    while ks[-1] < len(cuttable):
        ks.append(min(len(cuttable), max(1, 2 * ks[-1])))
    best = None
    for k in ks:
        cut = dl._CutPrefix(tuple(cu), p, causal, cuttable)  # anew for every pass
        (whole, pieces, _), work = dl._assign(tuple(cu), p, causal, cut, k, docs)
        heads, work = dl._even_out(tuple(cu), p, causal, cuttable[0], work) if causal and k else (None, work)
        assigned = (whole, pieces, k, heads)
        score = max(work) / (sum(work) / p)
        if score <= dl.TARGET_IMBALANCE:
            return score, assigned
        if best is None or score < best[0] - 1e-9:
            best = (score, assigned)
    return best


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_passes_that_cannot_meet_the_target_are_skipped_without_changing_the_layout(p, causal):
    """The search skips a k whose longest whole document already lifts a rank above the target, and
    stops a pass once a rank is above it: on mixes of every kind (including ones no k balances) it
    keeps what running every pass in full keeps."""
    from dilated.parallel import document_layout as dl

    gen = torch.Generator().manual_seed(p * 2 + causal)
    specs = [("lognormal:1k,1.0", 3 << 16), ("lognormal:8k,1.0", 3 << 17), ("lognormal:8k,2.0", 3 << 17),
             ("uniform:1k-64k", 3 << 17)]  # N divisible by every P here
    mixes = [cu_seqlens_of(f"{spec}#{i}", n) for spec, n in specs for i in range(1, 6)]
    for _ in range(10):  # a few long documents among many short ones, too short to cut into pieces of 128
        lengths = torch.randint(1, 64, (200,), generator=gen)
        lengths[torch.randint(0, 200, (3,), generator=gen)] = torch.randint(100, 2 * p * 128, (3,), generator=gen)
        cu = [0] + torch.cumsum(lengths, 0).tolist()
        cu[-1] += -cu[-1] % p  # N divisible by P
        mixes.append(cu)
    missed = 0
    for cu in mixes:
        docs = dl._documents(tuple(cu), causal)
        cut = dl._CutPrefix(tuple(cu), p, causal, [d for _, _, d in docs.in_order])  # one for both passes
        for min_piece in (128, 16):
            got = dl._search(tuple(cu), p, causal, min_piece, docs, cut)
            want = _search_in_full(cu, p, causal, min_piece)
            assert got[0] == want[0] and got[1] == want[1], cu[:6]
            missed += want[0] > dl.TARGET_IMBALANCE
    assert missed  # the fallback (no k within the target) was exercised


@pytest.mark.parametrize("p", [2, 3, 8, 64])
def test_each_prefix_of_documents_cut_head_tail_leaves_the_room_and_work_of_its_pieces(p):
    """The ranks' room and work with the first k documents (in the search's order) cut head-tail, as
    kept for every k, against their pieces counted position by position; every cut document's pieces
    cover its positions once, in runs that follow each other."""
    from dilated.parallel import document_layout as dl

    cu = tuple(cu_seqlens_of("lognormal:8k,1.0", 64 * 8192))
    for causal in (True, False):
        docs = dl._documents(cu, causal)
        order = [d for _, _, d in docs.in_order][:40]
        cut = dl._CutPrefix(cu, p, causal, order)
        for k in (0, 7, 1, 40, 3):  # asked out of order: the prefixes kept, not recomputed
            room, load = cut.at(k)
            pieces = cut.pieces(k)
            held = [sum(x.length for x in mine) for mine in pieces]
            assert room == [cu[-1] // p - h for h in held]
            assert load == [sum(_work_of_positions(cu, torch.arange(x.start, x.start + x.length), causal)
                                for x in mine) for mine in pieces]
            for d in order[:k]:
                mine = sorted((x for m in pieces for x in m if x.doc == d), key=lambda x: x.start)
                assert [x.start for x in mine] == list(itertools.accumulate((x.length for x in mine[:-1]),
                                                                            initial=cu[d]))
                assert sum(x.length for x in mine) == cu[d + 1] - cu[d]


def test_crossing_pieces_sit_where_the_ranks_pieces_put_them():
    """Each crossing piece's offset in its rank's shard (found from the documents held whole) is the
    rows of the rank's pieces before it."""
    import itertools

    short = list(range(0, 3 << 14, 1000)) + [3 << 14]  # too short to cut head-tail: cut at the ranks' room
    mixes = [("lognormal:1k,1.0", 4), ("lognormal:8k,1.0", 8), ("uniform:1k-64k", 3)]
    cases = [(cu_seqlens_of(spec, 3 << 17), p, causal) for spec, p in mixes for causal in (True, False)]
    for cu, p, causal in cases + [(short, 4, True), (short, 3, False)]:
        layout = DocumentLayout.balance(cu, p, causal)
        assert layout.crossing()
        for r in range(p):
            mine = layout.pieces_of(r)
            offsets = itertools.accumulate((x.length for x in mine), initial=0)
            want = tuple((x, off) for x, off in zip(mine, offsets) if x.doc in layout.crossing())
            assert layout.crossing_pieces(r) == want


def test_ranges_to_positions_against_the_ranges_written_out():
    from dilated.parallel.document_layout import ranges_to_positions

    gen = torch.Generator().manual_seed(3)
    cases = [([40, 3, 100, 7], [5, 1, 0, 4]), ([0, 5, 8, 9], [5, 3, 1, 2]), ([1, 2, 4], [1, 2, 3]), ([0], [7]),
             ([6, 0, 3], [2, 3, 3])]  # runs that go on from the range before, from 0 and from 1, jumps back
    for _ in range(20):
        k = int(torch.randint(1, 12, (1,), generator=gen))
        starts, lengths = torch.randint(0, 50, (k,), generator=gen), torch.randint(0, 6, (k,), generator=gen)
        cases.append((starts.tolist(), lengths.tolist()))
    for starts, lengths in cases:
        want = [p for s, n in zip(starts, lengths) for p in range(s, s + n)]
        assert ranges_to_positions(starts, lengths).tolist() == want, (starts, lengths)
    assert ranges_to_positions(starts, lengths, "cpu").dtype == torch.int64
    assert ranges_to_positions([], []).numel() == 0 and ranges_to_positions([5], [0]).numel() == 0


def test_positions_on_a_device_are_the_hosts():
    cu = cu_seqlens_of("lognormal:1k,1.0", 1 << 14)
    layout = DocumentLayout.balance(cu, 4, True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":  # made there without the host waiting for the GPU
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        on = [layout.positions(r, device) for r in range(4)]
        order = layout.order(device)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    for r in range(4):
        assert on[r].device.type == device and torch.equal(on[r].cpu(), layout.positions(r))
        assert layout.positions(r, device) is on[r]  # kept with the layout, per device
    assert torch.equal(order.cpu(), layout.order())


@pytest.mark.parametrize("p", [2, 3, 4])
def test_head_tail_gives_every_rank_chunks_r_and_2p_minus_1_minus_r_of_every_document(p):
    """DocumentLayout.head_tail, position by position: a document of a multiple of 2P positions is
    cut into 2P chunks of which rank r holds chunk r and chunk 2P-1-r (TransformerEngine's THD
    layout), so it crosses every rank; P documents of one position fill the one position each rank
    has left, whole."""
    c = 6
    lengths = [2 * p * c, 2 * p * 2 * c, 2 * p * 3 * c] + [1] * p
    cu = [0]
    for m in lengths:
        cu.append(cu[-1] + m)
    n = cu[-1]
    layout = DocumentLayout.head_tail(cu, p, True)
    _check_partition(layout, n, p)
    owner = torch.empty(n, dtype=torch.long)
    for r in range(p):
        owner[layout.positions(r)] = r
    for d in (0, 1, 2):  # multiples of 2P positions
        a, b = cu[d], cu[d + 1]
        chunk = (b - a) // (2 * p)
        expect = [min(j, 2 * p - 1 - j) for j in range(2 * p) for _ in range(chunk)]
        assert owner[a:b].tolist() == expect, d
    assert sorted(owner[cu[3:-1]].tolist()) == list(range(p))  # one short document on each rank
    assert layout.crossing() == frozenset({0, 1, 2})


@pytest.mark.parametrize("spec,n", [("lognormal:8k,1.0", 1 << 18), ("lognormal:1k,1.0", 1 << 20)])
@pytest.mark.parametrize("p", [2, 4])
def test_head_tail_balances_each_document_over_the_ranks(spec, n, p):
    """Each rank's work, counted position by position, within a hair of the mean (every document of
    2P positions or more split evenly); every such document crosses every rank."""
    cu = cu_seqlens_of(spec, n)
    layout = DocumentLayout.head_tail(cu, p, True)
    _check_partition(layout, n, p)
    work = [_work_of_positions(cu, layout.positions(r), True) for r in range(p)]
    assert max(work) / (sum(work) / p) < 1.002, work
    assert layout.work_per_rank() == work
    assert len(layout.crossing()) == sum(1 for a, b in zip(cu, cu[1:]) if b - a >= 2 * p)


@pytest.mark.parametrize("p", [2, 4])
def test_the_first_document_cut_head_tail_is_split_again_so_that_fewer_documents_cross(p):
    """On a mix whose longest document must be cut (a rank holding it whole would do most of the work)
    and whose whole documents then leave the ranks 1.4% apart, that document's pieces are re-split
    between each rank's head and tail (each rank keeping its share of its positions): the ranks come
    within the target without cutting the next longest document too."""
    from dilated.parallel import document_layout as dl

    n = 1 << 18
    cu = cu_seqlens_of("lognormal:8k,1.0", n)
    layout = DocumentLayout.balance(cu, p, causal=True)
    _check_partition(layout, n, p)
    work = [_work_of_positions(cu, layout.positions(r), True) for r in range(p)]
    assert work == layout.work_per_rank() and max(work) / (sum(work) / p) <= dl.TARGET_IMBALANCE, work
    longest = max(range(len(cu) - 1), key=lambda d: cu[d + 1] - cu[d])
    cut_head_tail = {x.doc for m in layout.pieces for x in m if x.length < cu[x.doc + 1] - cu[x.doc]}
    assert longest in cut_head_tail and len(layout.crossing()) <= 2, layout.crossing()  # + one cut at a rank's room
    held = [sum(x.length for x in layout.pieces_of(r) if x.doc == longest) for r in range(p)]
    assert held == dl._shares(cu[longest + 1] - cu[longest], p, 0)  # each rank's share of its positions, as an even cut
    heads = [min(x.start for x in layout.pieces_of(r) if x.doc == longest) for r in range(p)]
    assert heads == sorted(heads) and heads[0] == cu[longest]  # rank r's head is piece r


@pytest.mark.parametrize("p", [2, 3, 5])
def test_even_out_moves_work_from_a_rank_to_the_later_ranks_by_their_shares(p):
    """One document cut head-tail beside other work that leaves the ranks uneven: its re-split keeps
    each rank's count of its positions and brings every rank within a row's worth of pairs of the mean
    (counted position by position); the pieces cover the document once, heads in rank order, then tails
    in reverse."""
    from dilated.parallel import document_layout as dl

    a, length = 100, 6007
    cu = (0, a, a + length, a + length + 93)
    even = dl._head_tail(a, length, p, 0)
    others = [100 * (r * 7919 % (p + 2)) * length // p for r in range(p)]  # what the ranks hold beside it
    load = [o + sum(_work_of_positions(cu, torch.arange(s, s + m), True) for q, s, m in even if q == r)
            for r, o in enumerate(others)]
    heads, work = dl._even_out(cu, p, True, 1, load)
    assert heads is not None and all(0 <= h <= m for h, m in zip(heads, dl._shares(length, p, 0)))
    pieces = dl._head_tail(a, length, p, 0, heads)
    assert [s for _, s, _ in pieces] == list(itertools.accumulate((m for _, _, m in pieces[:-1]), initial=a))
    assert sum(m for _, _, m in pieces) == length
    assert [r for r, _, _ in pieces] == [r for r in range(p) if heads[r]] + [
        r for r in reversed(range(p)) if dl._shares(length, p, 0)[r] - heads[r]]
    counted = [o + sum(_work_of_positions(cu, torch.arange(s, s + m), True) for q, s, m in pieces if q == r)
               for r, o in enumerate(others)]
    assert counted == work
    assert max(work) - min(work) <= 2 * length and max(work) < max(load), (load, work)
