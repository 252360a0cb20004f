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
