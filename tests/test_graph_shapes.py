"""cuDNN's per-shape graphs: a shape's first calls go to a kernel that builds nothing per shape."""
import pytest
import torch

import dilated
from dilated.backends import get_backend, record_kernels
from dilated.backends.graph_shapes import ENV, GraphShapes, build_after_from_env, one_operation, shape_key
from dilated.reference import dilated_reference

from conftest import TOL, rand, rel_err


def test_a_shape_builds_at_its_nth_call():
    shapes = GraphShapes(3)
    assert [shapes.build("a") for _ in range(5)] == [False, False, True, True, True]
    assert [shapes.build("b") for _ in range(3)] == [False, False, True]  # counted per shape
    assert all(GraphShapes(1).build(k) for k in "abc")


def test_a_shape_counts_once_per_operation():
    """One dilated forward calls a shape several times (per head offset, per segment): all of them
    take the kernel of the operation's first call, and the next operation builds."""
    shapes = GraphShapes(2)
    with one_operation():
        assert [shapes.build("a") for _ in range(3)] == [False] * 3
        with one_operation():  # nested: the outer operation counts
            assert not shapes.build("a")
    with one_operation():
        assert [shapes.build("a") for _ in range(2)] == [True, True]

    @one_operation()
    def op(key):
        return [shapes.build(key), shapes.build(key)]

    assert op("b") == [False, False] and op("b") == [True, True]


def test_shape_keys_follow_what_a_graph_is_built_for():
    x = torch.empty(2, 4, 8, 16)
    base = shape_key((x, x), "forward", False)
    assert base == shape_key((x.clone(), x), "forward", False)  # other data, same graph
    assert base != shape_key((x[:1], x), "forward", False)  # another batch
    assert base != shape_key((x.transpose(1, 2).contiguous().transpose(1, 2), x), "forward", False)  # strides
    assert base != shape_key((x, x), "forward", True) and base != shape_key((x, x), "backward", False)
    assert base != shape_key((x.half(), x.half()), "forward", False)


@pytest.mark.parametrize("value", ["0", "-1", "two", ""])
def test_bad_build_after_names_the_variable(value, monkeypatch):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=ENV):
        build_after_from_env()
    with pytest.raises(ValueError, match=ENV):
        GraphShapes().build("a")


def test_build_after_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "4")
    shapes = GraphShapes()
    assert [shapes.build("a") for _ in range(4)] == [False, False, False, True] and shapes.build_after == 4
    monkeypatch.delenv(ENV)
    assert build_after_from_env() == 2


@pytest.mark.skipif(not torch.cuda.is_available() or not torch.backends.cudnn.is_available(), reason="needs cuDNN")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cudnn_first_calls_run_flash_then_build(causal, gen, monkeypatch):
    """A dilated call at a new length: its first call runs the new shapes on the flash kernel, the
    second builds cuDNN's graphs; both right against float64, forward and gradients."""
    backend = get_backend("sdpa_cudnn", device="cuda")
    monkeypatch.setattr(backend, "graph_shapes", GraphShapes(2))
    n, segs, dils = 1000 + 16 * causal, [128, 256, 512], [1, 2, 4]
    q, k, v = (rand(1, n, 8, 64, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_() for _ in range(3))
    dout = rand(1, n, 8, 64, gen=gen, dtype=torch.bfloat16).cuda()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dilated_reference(qd, kd, vd, segs, dils, causal)
    ref_g = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    ran = []
    for _ in range(2):
        with record_kernels() as kernels:
            out = dilated.improved_dilated_attention(q, k, v, segs, dils, causal=causal, backend="sdpa_cudnn")
            grads = torch.autograd.grad(out, (q, k, v), dout)
        ran.append(kernels)
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        for g, rg in zip(grads, ref_g):
            assert rel_err(g, rg) < 2 * TOL[torch.bfloat16]
    assert ran == [{"sdpa_cudnn", "sdpa_flash"}, {"sdpa_cudnn"}]
