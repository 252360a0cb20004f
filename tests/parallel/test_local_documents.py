"""Which packed documents stay where they lie (:mod:`dilated.parallel.local_documents`), against a
count over every position."""
import random

import pytest

from dilated.parallel.local_documents import LOCAL_IMBALANCE, contiguous_ranges, local_documents


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
    one_run = all(not w or sum(m for _, m in w) == w[-1][0] + w[-1][1] - w[0][0] for w in map(sorted, whole))
    if not any(whole) or not one_run:
        assert got is None
        return
    assert list(got.crossing) == crossing
    for mine, span in zip(whole, got.spans):
        if not mine:
            assert span is None
            continue
        mine.sort()
        lo, hi, cu_local = span
        assert (lo, hi) == (mine[0][0], mine[-1][0] + mine[-1][1])
        assert [b - a for a, b in zip(cu_local, cu_local[1:])] == [m for _, m in mine]
    imbalance = max(work) / (sum(work) / p)
    assert got.imbalance == pytest.approx(imbalance)
    auto = local_documents("auto", cu, ranges, causal)
    assert (auto is not None) == (imbalance <= LOCAL_IMBALANCE)
    assert local_documents(False, cu, ranges, causal) is None


def test_documents_of_one_length_on_the_shards_boundaries_all_stay():
    cu = list(range(0, 1 << 18, 8192)) + [1 << 18]
    got = local_documents("auto", cu, contiguous_ranges(1 << 18, 4), True)
    assert got.crossing == () and got.imbalance == 1.0
    assert all(span == (0, 1 << 16, tuple(range(0, (1 << 16) + 1, 8192))) for span in got.spans)
    # a boundary that cuts one document by a row: it crosses
    cu = [0, (1 << 16) + 1, *range((1 << 16) + 8192, (1 << 18) + 1, 8192)]
    got = local_documents("always", cu, contiguous_ranges(1 << 18, 4), True)
    assert got.crossing == (0,) and got.spans[0] is None and got.spans[1][0] == 1

