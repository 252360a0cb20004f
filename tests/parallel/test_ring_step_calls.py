import pytest

from dilated.bench.flops import visible_pairs
from dilated.parallel.ring_attention import step_calls


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_the_ring_steps_cover_the_attention_once(layout, p, causal):
    n = 24  # rows per rank
    pairs = 0
    for rank in range(p):
        for step in range(p):
            for qs, ks, c, docs in step_calls(step, rank, p, n, causal, layout):
                assert docs is None
                pairs += visible_pairs(qs.stop - qs.start, ks.stop - ks.start, c)
    assert pairs == visible_pairs(p * n, p * n, causal)


def test_with_documents_the_steps_cover_each_document_once():
    p, n, cu = 3, 40, (0, 7, 50, 51, 90, 120)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    pairs = 0
    for rank in range(p):
        for step in range(p):
            for qs, ks, c, docs in step_calls(step, rank, p, n, True, "zigzag", cu):
                if docs is None:
                    pairs += visible_pairs(qs.stop - qs.start, ks.stop - ks.start, c)
                else:
                    pairs += sum(visible_pairs(b - a, b - a, c) for a, b in zip(docs, docs[1:]))
    assert pairs == sum(m * (m + 1) // 2 for m in lengths)
