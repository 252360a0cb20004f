"""A contiguous or zigzag ring on packed documents: what its ranks attend, and the warning that
names the documents' layout where they leave the ranks uneven."""
import random

import pytest

import cp_worker
from conftest import free_port, spawn


@pytest.mark.parametrize("seed", range(12))
def test_ring_shard_work_matches_the_benchmarks_count_over_positions(seed):
    """What a contiguous or zigzag ring's ranks attend within packed documents (the figure its
    warning about uneven documents reads) against the benchmark's count over every position."""
    from dilated.bench.workload import documents_work_per_rank
    from dilated.parallel.ring_attention import shard_work

    rng = random.Random(seed)
    p = rng.choice([2, 3, 4])
    n = 2 * p * rng.choice([5, 16, 40])
    cu = [0, *sorted(rng.sample(range(1, n), rng.randint(0, n // 4))), n]
    for layout in ("contiguous", "zigzag"):
        for causal in (True, False):
            assert shard_work(cu, p, layout, causal) == pytest.approx(documents_work_per_rank(cu, causal, p, layout))


def test_a_ring_warns_once_where_documents_leave_its_ranks_uneven():
    spawn(cp_worker.ring_uneven_documents_warn, args=(2, free_port()), nprocs=2)
