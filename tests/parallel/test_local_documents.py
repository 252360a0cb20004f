"""Which packed documents stay where they lie (:mod:`dilated.parallel.local_documents`), against a
count over every position."""
import random

import pytest

from dilated.parallel.local_documents import LOCAL_IMBALANCE, MOST_EXCHANGED, contiguous_ranges, local_documents


def _by_position(cu, ranges, causal):
    """(crossing documents, per rank its whole documents' (local start, length), per rank work) from
    each position's owner and local row, and each query's attended keys."""
    owner, row = {}, {}
    for r, mine in enumerate(ranges):
        at = 0
        for start, length in mine:
            for i in range(length):
                owner[start + i], row[start + i] = r, at + i
            at += length
    crossing, whole, work = [], [[] for _ in ranges], [0.0] * len(ranges)
    for d, (a, b) in enumerate(zip(cu, cu[1:])):
        pairs = sum((i - a + 1) if causal else (b - a) for i in range(a, b))
        rows = [row[i] for i in range(a, b)]
        if len({owner[i] for i in range(a, b)}) == 1 and rows == list(range(rows[0], rows[0] + b - a)):
            whole[owner[a]].append((rows[0], b - a))
            work[owner[a]] += pairs
        else:
            crossing.append(d)
            work = [w + pairs / len(ranges) for w in work]
    return crossing, whole, work


@pytest.mark.parametrize("seed", range(40))
def test_local_documents_match_a_count_over_every_position(seed):
    rng = random.Random(seed)
    p = rng.choice([2, 3, 4])
    n = p * rng.choice([6, 10, 16])
    cuts = sorted(rng.sample(range(1, n), rng.randint(1, n // 3)))
    cu, causal = [0, *cuts, n], rng.random() < 0.5
    if seed % 4 == 0:  # contiguous shards (Ulysses); else each rank's positions in runs in sequence order
        ranges = contiguous_ranges(n, p)
    else:
        cut = sorted(rng.sample(range(1, n), 3 * p - 1))
        runs = [(a, b - a) for a, b in zip([0, *cut], [*cut, n])]
        owner = [r % p for r in range(len(runs))]
        rng.shuffle(owner)
        ranges = [[x for x, o in zip(runs, owner) if o == r] for r in range(p)]
    crossing, whole, work = _by_position(cu, ranges, causal)
    got = local_documents("always", cu, ranges, causal)
    if not any(whole):
        assert got is None and local_documents("auto", cu, ranges, causal) is None
        return
    assert list(got.exchanged) == crossing
    for mine, span, r in zip(whole, got.spans, range(p)):
        assert list(span) == sorted(mine)
        assert [b - a for a, b in zip(got.local_cu(r), got.local_cu(r)[1:])] == [m for _, m in sorted(mine)]
    assert got.work == pytest.approx(work)
    assert local_documents(False, cu, ranges, causal) is None
    # "auto": the crossing documents and some whole ones exchanged; its work as counted over positions
    # for that choice; the slowest rank within LOCAL_IMBALANCE of the mean, or it keeps nothing local
    auto = local_documents("auto", cu, ranges, causal)
    if auto is None:
        return
    assert sum(cu[d + 1] - cu[d] for d in auto.exchanged) <= MOST_EXCHANGED * n
    assert set(crossing) <= set(auto.exchanged)
    starts = {cu[d] for d in auto.exchanged}
    kept = [[(a, m) for a, m in sorted(mine) if _global(ranges[r], a) not in starts] for r, mine in enumerate(whole)]
    assert [list(x) for x in auto.spans] == kept
    moved = sum(_pairs(cu[d], cu[d + 1], causal) for d in auto.exchanged)
    counted = [sum(_pairs(0, m, causal) for _, m in mine) + moved / p for mine in kept]
    assert auto.work == pytest.approx(counted)
    slowest = max(range(p), key=counted.__getitem__)
    assert auto.imbalance <= LOCAL_IMBALANCE + 1e-12 or not kept[slowest]


def _global(mine, row):
    """The global position of local row ``row`` of a rank holding runs ``mine``."""
    for start, length in mine:
        if row < length:
            return start + row
        row -= length
    raise AssertionError(row)


def _pairs(a, b, causal):
    return sum((i - a + 1) if causal else (b - a) for i in range(a, b))


def test_documents_of_one_length_on_the_shards_boundaries_all_stay():
    cu = list(range(0, 1 << 18, 8192)) + [1 << 18]
    got = local_documents("auto", cu, contiguous_ranges(1 << 18, 4), True)
    assert got.exchanged == () and got.imbalance == 1.0
    assert all(got.local_rows(r) == slice(0, 1 << 16) and got.local_cu(r) == tuple(range(0, (1 << 16) + 1, 8192))
               for r in range(4))
    # a boundary that cuts one document by a row: it crosses
    cu = [0, (1 << 16) + 1, *range((1 << 16) + 8192, (1 << 18) + 1, 8192)]
    got = local_documents("always", cu, contiguous_ranges(1 << 18, 4), True)
    assert got.exchanged == (0,) and got.spans[0] == () and got.spans[1][0][0] == 1


def test_auto_exchanges_the_long_document_that_unbalances_a_shard():
    """One long document in the middle of rank 0's shard, short ones around it and on rank 1: "auto"
    exchanges the long one alone, and rank 0's own documents are two runs of rows."""
    cu = [0, 4, 8, 40, 44, 48, *range(49, 97)]
    got = local_documents("auto", cu, contiguous_ranges(96, 2), True)
    assert got.exchanged == (2,)
    assert got.local_rows(0) == ([0, 4, 40, 44], [4, 4, 4, 4]) and got.local_rows(1) == slice(0, 48)
    assert got.imbalance < LOCAL_IMBALANCE
    assert local_documents("always", cu, contiguous_ranges(96, 2), True).exchanged == ()


@pytest.mark.parametrize("spec, n, kept", [
    ("lognormal:1k,1.0", 1 << 18, True),   # a few long documents exchanged, a quarter of the rows
    ("lognormal:1k,1.0", 1 << 20, True),
    ("lognormal:8k,1.0", 1 << 20, True),   # 43% of the rows
    ("lognormal:8k,1.0", 1 << 18, False),  # balance would exchange 80% of the rows: every document goes
    ("fixed:8k", 1 << 18, True),           # nothing exchanged
])
def test_auto_keeps_documents_local_only_where_at_most_half_the_rows_move(spec, n, kept):
    """Ulysses' "auto" at P=4 on the mixes measured both ways: local documents where they were faster
    than every document exchanged, none where the document groups were (docs/performance-log.md)."""
    from dilated.bench.documents import cu_seqlens_of

    assert (local_documents("auto", cu_seqlens_of(spec, n), contiguous_ranges(n, 4), True) is not None) == kept


@pytest.mark.parametrize("seed", range(20))
def test_own_documents_parts_are_the_cut_of_about_equal_work(seed):
    """Two parts of a rank's documents in local order, together its documents, the cut where the
    parts' work (counted over every query) is nearest equal; one part for one document."""
    rng = random.Random(seed)
    p, causal = 2, seed % 2 == 0
    n = p * 64
    cu = [0, *sorted(rng.sample(range(1, n), rng.randint(2, 20))), n]
    got = local_documents("always", cu, contiguous_ranges(n, p), causal)
    for r in range(p):
        mine = got.spans[r] if got else ()
        parts = got.part_spans(r) if got else ()
        if len(mine) < 2:
            assert parts == ((mine,) if mine else ())
            continue
        assert len(parts) == 2 and parts[0] + parts[1] == mine and parts[0] and parts[1]

        def work(spans):
            return sum(_pairs(0, m, causal) for _, m in spans)
        best = min(abs(work(mine[:i]) - work(mine[i:])) for i in range(1, len(mine)))
        assert abs(work(parts[0]) - work(parts[1])) == best
