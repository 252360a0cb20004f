"""How Ulysses' heads are cut into groups (the groups' exchanges and attention are checked against
float64 on real process groups in tests/parallel/test_context_parallel.py)."""
import pytest

from dilated.parallel.head_groups import check_head_groups, head_groups_for, kv_group_of


def test_each_q_group_reads_the_kv_group_of_its_heads():
    # 8 q heads reading 2 kv heads (q head i reads kv head i // 4)
    assert kv_group_of(8, 2, 1) == [0]
    assert kv_group_of(8, 2, 2) == [0, 1]
    assert kv_group_of(8, 2, 4) == [0, 0, 1, 1]
    assert kv_group_of(8, 8, 4) == [0, 1, 2, 3]
    assert kv_group_of(3, 1, 3) == [0, 0, 0]
    with pytest.raises(ValueError, match="head_groups must be a positive integer dividing the 8 q heads"):
        kv_group_of(8, 2, 3)
    with pytest.raises(ValueError, match="cannot be cut into groups"):
        kv_group_of(12, 4, 6)  # 6 groups of 2 q heads over 4 kv heads of 3 q heads each


def test_auto_pipelines_two_groups_only_where_each_is_one_kernel_call():
    assert head_groups_for("auto", 8, 2, one_call=True) == 2
    assert head_groups_for("auto", 8, 2, one_call=False) == 1
    assert head_groups_for("auto", 3, 1, one_call=True) == 1  # 3 heads do not split in two
    assert head_groups_for("auto", 4, 1, one_call=True) == 2  # one kv head read by both groups
    assert head_groups_for(4, 8, 2, one_call=False) == 4
    with pytest.raises(ValueError, match="dividing the 8 q heads"):
        head_groups_for(5, 8, 2, one_call=True)
    for bad in (0, -1, True, 2.0, "two"):
        with pytest.raises(ValueError, match="head_groups must be 'auto' or a positive integer"):
            check_head_groups(bad)
