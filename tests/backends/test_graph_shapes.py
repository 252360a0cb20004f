"""cuDNN's per-shape graphs: a shape's first calls go to a kernel that builds nothing per shape."""
import collections

import pytest
import torch

import dilated
from dilated.backends import get_backend, record_kernels
from dilated.backends.graph_shapes import (ENV, GraphShapes, build_after_from_env, build_at_first_call,
                                          building_at_first_call, no_build, one_operation, shape_key)
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


def test_no_build_never_builds_but_uses_what_is_built():
    shapes = GraphShapes(2)
    with no_build():
        assert [shapes.build("a") for _ in range(3)] == [False] * 3  # not counted either
    assert [shapes.build("a"), shapes.build("a")] == [False, True]
    with no_build():
        assert shapes.build("a")  # built already: used
    with no_build(False):
        assert not shapes.build("b")


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


class _CountingOps:
    """``torch.ops.aten`` that counts the calls of each op."""

    def __init__(self, ops):
        self.ops, self.calls = ops, collections.Counter()

    def __getattr__(self, name):
        op = getattr(self.ops, name)

        def call(*args, **kwargs):
            self.calls[name] += 1
            return op(*args, **kwargs)

        return call


@pytest.mark.skipif(not torch.cuda.is_available() or not torch.backends.cudnn.is_available(), reason="needs cuDNN")
@pytest.mark.parametrize("name", ["sdpa_cudnn", "sdpa"])
@pytest.mark.parametrize("n, causal", [(1024, False), (1000, True)])
def test_gpu_cudnn_first_calls_run_flash_then_build(name, n, causal, gen, monkeypatch):
    """A dilated call at a new length: its first call runs every call on the flash kernel, the
    second builds cuDNN's graphs for the full segments (a clipped last segment, N = 1000, stays on
    flash); every call right against float64, forward and gradients. ``sdpa`` the same where
    PyTorch's choice is cuDNN, and rows name cuDNN, not ``sdpa``."""
    dilated.available_backends("cuda")  # its probe calls are made before the counting starts
    backend = get_backend(name, device="cuda")
    x = torch.zeros(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16)
    if backend.kernel_name(x, x, causal) != "sdpa_cudnn":
        pytest.skip(f"PyTorch's SDPA choice here is {backend.kernel_name(x, x, causal)}")
    monkeypatch.setattr(backend, "graph_shapes", GraphShapes(2))
    ops = _CountingOps(torch.ops.aten)
    monkeypatch.setattr("dilated.backends.sdpa.aten", ops)
    segs, dils = [128, 256, 512], [1, 2, 4]
    q, k, v = (rand(1, n, 8, 64, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_() for _ in range(3))
    dout = rand(1, n, 8, 64, gen=gen, dtype=torch.bfloat16).cuda()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dilated_reference(qd, kd, vd, segs, dils, causal)
    ref_g = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    counts, ran = [], []
    for _ in range(3):
        ops.calls.clear()
        with record_kernels() as kernels:
            out = dilated.improved_dilated_attention(q, k, v, segs, dils, causal=causal, backend=name)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        counts.append({name.split("_")[4] + ("_bwd" if name.endswith("backward") else ""): c
                       for name, c in ops.calls.items()})
        ran.append(kernels)
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        for g, rg in zip(grads, ref_g):
            assert rel_err(g, rg) < 2 * TOL[torch.bfloat16]
    first, second, third = counts
    assert set(first) == {"flash", "flash_bwd"} and ran[0] == {"sdpa_cudnn", "sdpa_flash"}
    assert second == third and second["cudnn"] > 0 and second["cudnn_bwd"] > 0
    if n % max(segs):  # the clipped last segments' calls stay on flash, the others are on cuDNN
        assert second["flash"] == second["flash_bwd"] > 0 and second["flash"] + second["cudnn"] == first["flash"]
    else:
        assert set(second) == {"cudnn", "cudnn_bwd"} and ran[1] == {"sdpa_cudnn"}


def test_calls_that_build_at_their_first_call():
    """Inside build_at_first_call a new shape builds at once (packed documents' batched calls);
    outside, the same object counts to build_after; a shape built inside stays built."""
    shapes = GraphShapes(3)
    with build_at_first_call():
        assert building_at_first_call()
        assert shapes.build("a") and shapes.build("a")
    assert not building_at_first_call()
    assert shapes.build("a")  # built inside: built outside too
    assert [shapes.build("b") for _ in range(3)] == [False, False, True]
    assert not shapes.build("c")  # once outside (the flash kernel) ...
    with build_at_first_call():
        assert shapes.build("c")  # ... then inside: builds now
    with no_build(), build_at_first_call():
        assert not shapes.build("d")  # no_build still wins over a shape not built


def test_packed_documents_batched_calls_build_at_their_first_call():
    """dilated.packed's batched calls run inside build_at_first_call, forward and backward; a single
    document (one dense call) does not."""
    from dilated.packed import documents_backward, documents_forward

    seen = []

    def attend(q, k, v):
        seen.append(("fwd", building_at_first_call()))
        return q.clone(), q.new_zeros(q.shape[0], q.shape[2], q.shape[1])

    def backward(dout, q, k, v, out, lse):
        seen.append(("bwd", building_at_first_call()))
        return q.clone(), k.clone(), v.clone()

    q = torch.randn(1, 64, 2, 8)
    cu = [0, 10, 30, 64]
    out, lse = documents_forward(q, q, q, cu, attend, True)
    documents_backward((q, q, q, q, out, lse), cu, backward, True)
    assert seen and all(inside for _, inside in seen) and {"fwd", "bwd"} == {d for d, _ in seen}
    seen.clear()
    documents_forward(q, q, q, [0, 64], attend, True)
    assert seen == [("fwd", False)]
