"""A grid row's exchange by documents (:func:`dilated.parallel.row_documents.row_plans`), against the
row's pieces and its ranks' parts written out position by position."""
import random

import pytest

from dilated.parallel.document_layout import DocumentLayout
from dilated.parallel.local_documents import contiguous_ranges, local_documents
from dilated.parallel.row_documents import by_documents_plans, pipelines, plans_for, row_plans, two_exchanges_pay


def _owner_of_rows(n_row: int, u: int) -> list[int]:
    """The rank of the row (0 .. u-1) that holds each position of the row's shard."""
    return [i // (n_row // u) for i in range(n_row)]


@pytest.mark.parametrize("seed", range(30))
def test_a_rows_plan_exchanges_the_crossing_pieces_and_keeps_only_pieces_within_one_part(seed):
    rng = random.Random(seed)
    r, u = rng.choice([(2, 2), (2, 4), (4, 2)])
    n = r * u * rng.choice([16, 32])
    cu = [0, *sorted(rng.sample(range(1, n), rng.randint(2, n // 6))), n]
    causal, setting = rng.random() < 0.5, rng.choice(["always", "auto"])
    layout = DocumentLayout.balance(cu, r, causal)
    crossing = layout.crossing()
    for row in range(r):
        plans = row_plans(layout, u, setting)
        if plans is None:
            continue
        plan = plans[row]
        pieces = layout.pieces_of(row)
        assert list(plan.cu) == [sum(x.length for x in pieces[:i]) for i in range(len(pieces) + 1)]
        owner = _owner_of_rows(plan.cu[-1], u)
        local = {}  # piece index -> rank that keeps it, from the spans
        for rank, spans in enumerate(plan.local.spans):
            at = 0
            for start, length in spans:  # a rank's local documents packed in its local order
                i = plan.cu.index(rank * (plan.cu[-1] // u) + start)
                assert plan.cu[i + 1] - plan.cu[i] == length and i not in local, (row, spans)
                local[i] = rank
                at += length
            assert plan.local.local_cu(rank)[-1] == at
        grouped = [i for g in plan.groups for i in g]
        assert sorted(grouped + list(local)) == list(range(len(pieces))), (grouped, local)
        for i, x in enumerate(pieces):
            rows = range(plan.cu[i], plan.cu[i + 1])
            if i in local:  # within one rank's part, and not of a document on another row
                assert {owner[j] for j in rows} == {local[i]} and x.doc not in crossing
            if x.doc in crossing:
                assert any(ring and i in g for g, ring in zip(plan.groups, plan.rings)), (i, plan)
            else:
                assert not any(ring and i in g for g, ring in zip(plan.groups, plan.rings)), (i, plan)
        assert sum(plan.rings) == (1 if crossing else 0)
        if setting == "always":  # every piece within one part that no other row shares stays
            assert all(i in local for i, x in enumerate(pieces)
                       if x.doc not in crossing and len({owner[j] for j in range(plan.cu[i], plan.cu[i + 1])}) == 1)


def test_rows_of_crossing_pieces_only_keep_nothing_local():
    layout = DocumentLayout.balance([0, 256], 2, True)  # one document: every piece crosses rows
    assert all(row_plans(layout, 2, s) is None for s in ("auto", "always", False))


def test_documents_exchanged_wherever_they_lie_are_not_kept():
    cu, ranges = [0, 4, 8, 18, 20, 32], contiguous_ranges(32, 2)  # document 2 crosses the ranks
    kept = local_documents("always", cu, ranges, True)
    forced = local_documents("always", cu, ranges, True, exchanged=[0, 3])
    assert kept.exchanged == (2,) and kept.spans == (((0, 4), (4, 4)), ((2, 2), (4, 12)))
    assert forced.exchanged == (0, 2, 3) and forced.spans == (((4, 4),), ((4, 12),))


@pytest.mark.parametrize("seed", range(20))
def test_a_rows_one_exchange_rings_its_exchanged_pieces_in_the_rows_order(seed):
    """``by_documents=False``: the row's pieces not kept move in one exchange, in the row's order, and
    the ring's layout holds on row ``j`` exactly those pieces' rows in that order: each a whole
    document of the row or a piece of a document across rows, at the same offsets within it."""
    rng = random.Random(100 + seed)
    r, u = rng.choice([(2, 2), (2, 4), (4, 2)])
    n = r * u * rng.choice([16, 32])
    cu = [0, *sorted(rng.sample(range(1, n), rng.randint(2, n // 6))), n]
    layout = DocumentLayout.balance(cu, r, rng.random() < 0.5)
    plans = row_plans(layout, u, "always", by_documents=False)
    if plans is None:
        return
    crossing = layout.crossing()
    by_documents = row_plans(layout, u, "always")
    for row, (plan, other) in enumerate(zip(plans, by_documents)):
        assert plan.local == other.local and plan.cu == other.cu  # the same documents kept
        moved = sorted(i for g in other.groups for i in g)
        assert [list(g) for g in plan.groups] == ([moved] if moved else [])
        assert plan.rings == ((bool(crossing),) if moved else ())
        if not crossing:
            assert plan.ring_layout is None
            continue
        pieces = layout.pieces_of(row)
        ring = plan.ring_layout.pieces_of(row)
        assert [x.length for x in ring] == [pieces[i].length for i in moved]
        for x, i in zip(ring, moved):
            y = pieces[i]
            assert (x.start - x.doc_start, x.doc_end - x.doc_start) == (y.start - y.doc_start, y.doc_end - y.doc_start)
            assert (y.doc in crossing) == (x.doc in plan.ring_layout.crossing())


@pytest.mark.parametrize("seed", range(30))
def test_auto_exchanges_at_once_beside_kept_documents_else_by_documents(seed):
    """``document_groups="auto"``: the one exchange where every row keeps documents; else, where every
    row holds crossing pieces and whole documents, the two groups (crossing pieces first, on the
    ring) for a ring of two rows on one host, and nothing (the whole shard at once) on more rows or
    across hosts. ``1`` never takes the groups; ``"always"`` always does."""
    rng = random.Random(200 + seed)
    r, u = rng.choice([(2, 2), (2, 4), (4, 2)])
    n = r * u * rng.choice([16, 32])
    cu = [0, *sorted(rng.sample(range(1, n), rng.randint(2, n // 4))), n]
    layout = DocumentLayout.balance(cu, r, rng.random() < 0.5)
    setting = rng.choice(["auto", "always", False])
    kept = row_plans(layout, u, setting, by_documents=False) if setting else None
    auto, once = plans_for(layout, u, setting, "auto"), plans_for(layout, u, setting, 1)
    assert once == kept
    assert plans_for(layout, u, setting, "auto", ring_on_one_host=False) == kept  # across hosts: never the groups
    if kept is not None:
        assert auto == kept and all(len(plan.groups) <= 1 for plan in auto)
    elif pipelines(layout) and r == 2:
        assert auto == by_documents_plans(layout)
        for row, plan in enumerate(auto):  # the row's crossing pieces on the ring, then its whole documents
            pieces = layout.pieces_of(row)
            assert plan.rings == (True, False) and plan.local is None
            assert [pieces[i].doc in layout.crossing() for g in plan.groups for i in g] == \
                [True] * len(plan.groups[0]) + [False] * len(plan.groups[1])
    else:
        assert auto is None
    expected = row_plans(layout, u, setting) if setting else None
    assert plans_for(layout, u, setting, "always") == (by_documents_plans(layout) if expected is None else expected)


def test_two_exchanges_pay_on_a_ring_of_two_rows_of_one_host():
    assert two_exchanges_pay(2, True)
    assert not two_exchanges_pay(2, False) and not two_exchanges_pay(4, True) and not two_exchanges_pay(1, True)


def test_row_document_groups_named_when_wrong():
    layout = DocumentLayout.balance([0, 40, 64], 2, True)
    for bad in (2, True, "never"):
        with pytest.raises(ValueError, match="document_groups must be 1"):
            plans_for(layout, 2, "auto", bad)
