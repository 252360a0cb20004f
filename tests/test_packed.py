"""Packed documents (``cu_seqlens``): attention within each document only, against a float64
reference that runs every document on its own."""
import pytest
import torch

import dilated
from dilated.packed import _bucket, document_calls
from dilated.reference import dense_reference

from conftest import rand, rel_err


def _per_document(q, k, v, cu, causal):
    outs, lses = [], []
    for a, b in zip(cu, cu[1:]):
        o, l = dense_reference(q[:, a:b], k[:, a:b], v[:, a:b], causal=causal)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, 1), torch.cat(lses, 2)


DOCS = {"one": [0, 40], "fixed": [0, 8, 16, 24, 32, 40], "varied": [0, 1, 6, 19, 20, 33, 40],
        "lognormal-like": [0, 3, 4, 11, 29, 31, 40]}


@pytest.mark.parametrize("docs", DOCS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["manual", "sdpa_math", "sdpa"])
def test_packed_documents_match_each_document_alone(docs, causal, backend, gen):
    cu = DOCS[docs]
    q = rand(2, 40, 4, 8, gen=gen, requires_grad=True)
    k, v = rand(2, 40, 2, 8, gen=gen, requires_grad=True), rand(2, 40, 2, 8, gen=gen, requires_grad=True)
    out, lse = dilated.attention(q, k, v, causal=causal, backend=backend, return_lse=True,
                                 cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _per_document(qd, kd, vd, cu, causal)
    assert rel_err(out, ref) < 2e-4 and rel_err(lse, ref_lse) < 2e-4
    dout, dlse = rand(*out.shape, gen=gen), rand(*lse.shape, gen=gen)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    ref_grads = torch.autograd.grad((ref, ref_lse), (qd, kd, vd), (dout.double(), dlse.double()))
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert rel_err(g, rg) < 4e-4, f"d{name}"


def test_documents_share_kernel_calls():
    cu = [0] + torch.tensor([8] * 50 + [9, 10, 11, 12, 13, 14, 15, 16] * 3).cumsum(0).tolist()
    assert len(document_calls(cu, causal=False)) == 9  # one call per distinct length
    causal_calls = document_calls(cu, causal=True)  # padded to four buckets per octave
    assert [length for length, _ in causal_calls] == [8, 10, 12, 14, 16]
    assert all(length <= 1.25 * min(l for _, l in docs) + 1 for length, docs in causal_calls)
    assert [_bucket(n) for n in (1000, 1025, 1300, 1600, 1800)] == [1024, 1280, 1536, 1792, 2048]


@pytest.mark.parametrize("bad, exc, says", [
    (torch.tensor([0, 10, 40], dtype=torch.int64), TypeError, "must be int32"),
    (torch.tensor([0, 10, 30], dtype=torch.int32), ValueError, "sum to N"),
    (torch.tensor([1, 10, 40], dtype=torch.int32), ValueError, "start at 0"),
    (torch.tensor([0, 20, 10, 40], dtype=torch.int32), ValueError, "strictly increasing"),
    (torch.tensor([0, 10, 10, 40], dtype=torch.int32), ValueError, "strictly increasing"),
    (torch.tensor([[0, 40]], dtype=torch.int32), ValueError, "1-d"),
    ([0, 40], TypeError, "must be a torch.Tensor"),
])
def test_bad_cu_seqlens_is_a_clear_error(bad, exc, says, gen):
    q = rand(1, 40, 2, 8, gen=gen)
    with pytest.raises(exc, match=says):
        dilated.attention(q, q, q, cu_seqlens=bad)


class _Aux:
    def __init__(self, lse=False):
        self.lse = lse


def _varlen_standin(newer: bool):
    """A CPU stand-in for ``torch.nn.attention.varlen.varlen_attn`` with the signature of torch
    2.13 (``window_size``, ``scale``, ``enable_gqa``, lse ``[T, H]``) or of an older release
    (``is_causal``, no scale, lse ``[H, T]``): each document computed alone in float64."""
    def run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, gqa, return_aux):
        assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
        cu = cu_seq_q.tolist()
        assert max_q == max(b - a for a, b in zip(cu, cu[1:]))
        if key.shape[1] != query.shape[1]:
            assert gqa, "fewer kv heads without enable_gqa"
        outs, lses = [], []
        for a, b in zip(cu, cu[1:]):
            o, l = dense_reference(query[None, a:b], key[None, a:b], value[None, a:b], causal=causal, scale=scale)
            outs.append(o[0].to(query.dtype))
            lses.append(l[0])
        out, lse = torch.cat(outs), torch.cat(lses, 1).float()  # lse [H, T]
        if return_aux is not None and return_aux.lse:
            return out, (lse.t() if newer else lse)
        return out

    if newer:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
            return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale, enable_gqa,
                       return_aux)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None, False, return_aux)
    return varlen_attn


@pytest.mark.parametrize("newer", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents_through_torch_varlen_kernel(newer, causal, monkeypatch, gen):
    from dilated import packed

    monkeypatch.setattr(packed, "varlen_kernel", lambda: (_varlen_standin(newer), _Aux))
    monkeypatch.setattr(packed, "varlen_reason", lambda q, k, v, backend: None)
    cu = DOCS["varied"]
    q = rand(2, 40, 4, 8, gen=gen, requires_grad=True)
    k, v = rand(2, 40, 2, 8, gen=gen, requires_grad=True), rand(2, 40, 2, 8, gen=gen, requires_grad=True)
    out, lse = dilated.attention(q, k, v, causal=causal, return_lse=True, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _per_document(qd, kd, vd, cu, causal)
    assert rel_err(out, ref) < 2e-4 and rel_err(lse, ref_lse) < 2e-4
    dout = rand(*out.shape, gen=gen)
    for name, g, rg in zip("qkv", torch.autograd.grad(out, (q, k, v), dout),
                           torch.autograd.grad(ref, (qd, kd, vd), dout.double())):
        assert rel_err(g, rg) < 4e-4, f"d{name}"


def _fa4_varlen_standin(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
                        softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
                        num_splits=1, pack_gqa=None, deterministic=False, return_lse=False, **more):
    """A CPU stand-in for flash-attn 4's ``flash_attn_varlen_func`` (flash_attn/cute/interface.py,
    4.0.0b36: packed ``[T, H, D]`` rows, GQA native, returns ``(out, lse [H, T])``): each document
    computed alone in float64 (differentiable)."""
    assert cu_seqlens_q.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_k) and return_lse
    cu = cu_seqlens_q.tolist()
    assert max_seqlen_q == max_seqlen_k == max(b - a for a, b in zip(cu, cu[1:]))
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for a, b in zip(cu, cu[1:]):
        kk, vv = (x[a:b].repeat_interleave(g, 1) for x in (k, v))
        o, l = dense_reference(q[None, a:b], kk[None], vv[None], causal=causal, scale=softmax_scale)
        outs.append(o[0].to(q.dtype))
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, 1).float()


@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents_through_flash_attn_4_varlen(causal, monkeypatch, gen):
    """``backend="flash_attn_4"`` sends packed documents to flash-attn 4's own varlen entry point
    (one call, lse ``[H, T]`` back to ``[B, H, N]``): against float64, forward and gradients."""
    import types

    from dilated import packed
    from dilated.backends import flash_attn_4

    monkeypatch.setattr(flash_attn_4, "_import", lambda: types.SimpleNamespace(flash_attn_varlen_func=_fa4_varlen_standin))
    monkeypatch.setattr(packed, "varlen_reason", lambda q, k, v, backend: None)
    monkeypatch.setattr(packed, "varlen_kernel", lambda: pytest.fail("torch's varlen kernel was called"))
    cu = DOCS["varied"]
    q = rand(2, 40, 4, 8, gen=gen, requires_grad=True)
    k, v = rand(2, 40, 2, 8, gen=gen, requires_grad=True), rand(2, 40, 2, 8, gen=gen, requires_grad=True)
    out, lse = dilated.attention(q, k, v, causal=causal, return_lse=True, backend="flash_attn_4",
                                 cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _per_document(qd, kd, vd, cu, causal)
    assert lse.shape == (2, 4, 40) and rel_err(out, ref) < 2e-4 and rel_err(lse, ref_lse) < 2e-4
    dout = rand(*out.shape, gen=gen)
    for name, g, rg in zip("qkv", torch.autograd.grad(out, (q, k, v), dout),
                           torch.autograd.grad(ref, (qd, kd, vd), dout.double())):
        assert rel_err(g, rg) < 4e-4, f"d{name}"


def test_when_the_varlen_kernel_is_not_used(gen):
    from dilated.packed import varlen_reason

    q = rand(1, 16, 2, 64, gen=gen)
    assert "by name" in varlen_reason(q, q, q, "manual")
    assert "CUDA" in varlen_reason(q, q, q, "auto")  # a CPU tensor
    assert "CUDA" in varlen_reason(q, q, q, "flash_attn_4")
