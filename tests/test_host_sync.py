"""A steady call makes the host wait for the GPU nowhere (GPU only).

A synchronizing operation inside a layer (``.item()``, ``.tolist()`` of a device tensor, a copy
from pageable memory) stops the host until every queued kernel has run, so the next launches leave
the GPU idle: in a model, once per layer and step. Each entry point runs twice to fill its caches
(plans, cuDNN graphs, block lists), then forward and backward once more under
``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronizing operation. A
CUDA-graph capture allows no sync either: training steps are captured and replayed."""
import contextlib

import pytest
import torch

import dilated

from conftest import captured, rand, training_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextlib.contextmanager
def syncs_raise():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def steady_call_does_not_sync(call, inputs, gen):
    """``call(*inputs)`` forward and backward: twice to warm up, then once with syncs raising."""
    dout = None
    for warm in (True, True, False):
        with contextlib.nullcontext() if warm else syncs_raise():
            out = call(*inputs)
            if dout is None:
                dout = rand(*out.shape, gen=gen, dtype=out.dtype).to(out.device)
            torch.autograd.backward(out, dout)
    torch.cuda.synchronize()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in inputs)


def qkv(gen, n=2048, heads=8, kv_heads=8, d=64, dtype=torch.bfloat16):
    q = rand(1, n, heads, d, gen=gen, dtype=dtype).cuda().requires_grad_()
    k, v = (rand(1, n, kv_heads, d, gen=gen, dtype=dtype).cuda().requires_grad_() for _ in range(2))
    return q, k, v


def skip_unless_available(backend):
    if dilated.available_backends("cuda").get(backend) is not None:
        pytest.skip(f"{backend} is not available here")


@pytest.mark.parametrize("backend", ["auto", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex",
                                     "flash_attn_4"])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_attention(backend, causal, gen):
    skip_unless_available(backend)
    steady_call_does_not_sync(lambda q, k, v: dilated.attention(q, k, v, causal=causal, backend=backend),
                              qkv(gen, kv_heads=2), gen)


def test_long_causal_calls_in_query_chunks(gen, monkeypatch):
    """cuDNN's long causal forward runs as query chunks merged by lse (here chunks of 512 rows)."""
    import dilated.backends.sdpa as sdpa

    skip_unless_available("sdpa_cudnn")
    monkeypatch.setattr(sdpa, "CUDNN_LONGEST_CAUSAL_BLOCK", 512)
    steady_call_does_not_sync(lambda q, k, v: dilated.attention(q, k, v, causal=True, backend="sdpa_cudnn"),
                              qkv(gen), gen)


@pytest.mark.parametrize("backend", ["auto", "flash_attn_4"])
def test_fewer_queries_than_keys(backend, gen):
    """Causal attention of the last queries over a longer prefix (bottom-right aligned)."""
    skip_unless_available(backend)
    q = qkv(gen, n=300)[0]
    k, v = qkv(gen, n=2048, heads=2, kv_heads=2)[1:]
    steady_call_does_not_sync(lambda q, k, v: dilated.attention(q, k, v, causal=True, backend=backend), (q, k, v), gen)


@pytest.mark.parametrize("improved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_dilated_attention(improved, causal, gen):
    cls = dilated.ImprovedDilatedAttention if improved else dilated.DilatedAttention
    attn = cls([512, 1024, 2048], [1, 2, 4], causal=causal)
    steady_call_does_not_sync(attn, qkv(gen, n=3000), gen)


def test_multihead_dilated_attention(gen):
    layer = dilated.MultiheadDilatedAttention(512, 8, [512, 1024], [1, 2], device="cuda", dtype=torch.bfloat16)
    x = rand(2, 2048, 512, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_()
    steady_call_does_not_sync(layer, (x,), gen)


def test_residue_major_layout(gen):
    attn = dilated.ImprovedDilatedAttention([1024, 2048, 4096], [1, 2, 4], layout="residue_major")
    steady_call_does_not_sync(attn, qkv(gen, n=8192, d=128), gen)


@pytest.mark.parametrize("backend", ["auto", "sdpa_cudnn", "flash_attn_4"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents_with_cu_seqlens_on_the_host(backend, causal, gen):
    """cu_seqlens given as a host tensor: its values are read without waiting for the GPU."""
    skip_unless_available(backend)
    cu = torch.tensor([0, 300, 1024, 1100, 2048], dtype=torch.int32)
    steady_call_does_not_sync(
        lambda q, k, v: dilated.attention(q, k, v, causal=causal, backend=backend, cu_seqlens=cu), qkv(gen), gen)


CAPTURED = {
    "dense": lambda causal: lambda q, k, v: dilated.attention(q, k, v, causal=causal),
    "dilated": lambda causal: dilated.ImprovedDilatedAttention([512, 1024, 2048], [1, 2, 4], causal=causal),
    "documents": lambda causal: lambda q, k, v: dilated.attention(
        q, k, v, causal=causal, cu_seqlens=torch.tensor([0, 300, 1024, 1100, 2048], dtype=torch.int32)),
}


@pytest.mark.parametrize("entry", list(CAPTURED))
@pytest.mark.parametrize("causal", [False, True])
def test_a_training_step_captures_in_a_cuda_graph(entry, causal, gen):
    """A capture allows no host sync: forward and backward captured once, then replayed on new
    inputs, give eager's output and gradients."""
    call = CAPTURED[entry](causal)
    q, k, v = qkv(gen, kv_heads=2)
    dout = rand(*q.shape, gen=gen, dtype=q.dtype).cuda()
    graph, out = captured(training_step(call, (q, k, v), dout), warmup=3)
    grads = (q.grad, k.grad, v.grad)
    fresh = qkv(gen, kv_heads=2)
    with torch.no_grad():
        for static, new in zip((q, k, v), fresh):
            static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    want = call(*fresh)
    assert torch.allclose(out, want, rtol=1e-2, atol=1e-2)
    for got, w in zip(grads, torch.autograd.grad(want, fresh, dout)):
        assert torch.allclose(got, w, rtol=1e-2, atol=1e-2)
