"""The references every row is held to, held to independent computations themselves."""
import math

import pytest
import torch
from conftest import rand

from dilated.reference import dense_reference, dilated_bias, dilated_reference, sampled_reference


def _softmax_attention_by_loops(q, k, v, causal, scale, allowed=None):
    """Row by row in float64, no masking tricks: the definition."""
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    out = torch.zeros(b, nq, h, v.shape[3], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hkv)
            for i in range(nq):
                keys = [j for j in range(nk) if (not causal or j <= i + nk - nq)
                        and (allowed is None or allowed[hi][i][j] > 0)]
                if not keys:
                    continue
                s = [float(q[bi, i, hi].double() @ k[bi, j, kh].double()) * scale
                     + (math.log(allowed[hi][i][j]) if allowed is not None else 0.0) for j in keys]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                tot = sum(w)
                out[bi, i, hi] = sum(wi / tot * v[bi, j, kh].double() for wi, j in zip(w, keys))
    return out


def _counts(n, h, segs, dils, causal):
    """How many branches select both i and j for head h (LongNet), by the definition."""
    c = [[[0] * n for _ in range(n)] for _ in range(h)]
    for w, r in zip(segs, dils):
        w = min(w, n)
        for hi in range(h):
            for i in range(n):
                for j in range(n):
                    if i // w == j // w and (i % w) % r == hi % r and (j % w) % r == hi % r and (not causal or j <= i):
                        c[hi][i][j] += 1
    return c


@pytest.mark.parametrize("nq,nk,causal,h,hkv", [(12, 12, False, 2, 2), (12, 12, True, 4, 2), (5, 12, True, 2, 1),
                                                 (12, 5, True, 2, 2)])
def test_dense_reference_is_the_definition(nq, nk, causal, h, hkv, gen):
    q, k, v = rand(1, nq, h, 4, gen=gen), rand(1, nk, hkv, 4, gen=gen), rand(1, nk, hkv, 4, gen=gen)
    want = _softmax_attention_by_loops(q, k, v, causal, 0.5)
    torch.testing.assert_close(dense_reference(q, k, v, causal=causal, scale=0.5)[0], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_dilated_reference_is_the_definition(causal, gen):
    n, h, segs, dils = 14, 3, [4, 8, 14], [1, 2, 3]
    q, k, v = (rand(1, n, h, 4, gen=gen) for _ in range(3))
    want = _softmax_attention_by_loops(q, k, v, False, 0.5, _counts(n, h, segs, dils, causal))
    got = dilated_reference(q, k, v, segs, dils, causal=causal, scale=0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    bias = dilated_bias(n, h, segs, dils, causal)
    # head 1, query 3, key 1: the w = 4 (r = 1) and w = 8 (r = 2, offset 1) branches select both
    assert bias[1, 3, 1].item() == pytest.approx(math.log(2))
    assert bias[0, 3, 1].item() == 0.0  # head 0: only the r = 1 branch (r = 2 takes even positions)
    assert bias[2, 3, 1].item() == 0.0  # head 2: w = 4 only (r = 2 takes even positions, r = 3 positions 2 mod 3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dilated", [False, True])
def test_sampled_reference_streams_to_the_float64_reference(causal, dilated, gen):
    """The long-N check's reference (sampled rows, key blocks streamed) against the dense float64
    one on the same rows: blocks smaller than N, rows at block edges, GQA, bottom-right causal."""
    n, h, hkv = 40, 4, 2
    q, k, v = rand(1, n, h, 8, gen=gen), rand(1, n, hkv, 8, gen=gen), rand(1, n, hkv, 8, gen=gen)
    rows = torch.tensor([0, 6, 7, 8, 20, 39])
    segs, dils = ([8, 16, 40], [1, 2, 4]) if dilated else (None, None)
    if dilated:
        want = dilated_reference(q, k, v, segs, dils, causal=causal)[:, rows]
    else:
        want = dense_reference(q, k, v, causal=causal)[0][:, rows]
    for block in (7, 16, 64):
        got = sampled_reference(q, k, v, rows, causal=causal, segment_lengths=segs, dilation_rates=dils, block=block,
                                dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # bottom-right causal with fewer queries than keys (decode-like rows)
    qs = q[:, -10:]
    got = sampled_reference(qs, k, v, torch.tensor([0, 9]), causal=True, block=16, dtype=torch.float64)
    torch.testing.assert_close(got, dense_reference(qs, k, v, causal=True)[0][:, [0, 9]], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dilated", [False, True])
def test_sampled_query_gradients_are_autograds(causal, dilated, gen):
    """The long-N gradient check's reference: dq of sampled rows, streamed, against autograd through
    the dense float64 reference (GQA, blocks smaller than N, a causal row that sees no key)."""
    n, h, hkv = 40, 4, 2
    q, k, v = (rand(1, n, hh, 8, gen=gen).double() for hh in (h, hkv, hkv))
    dout = rand(1, n, h, 8, gen=gen).double()
    rows = torch.tensor([0, 6, 7, 8, 20, 39])
    segs, dils = ([8, 16, 40], [1, 2, 4]) if dilated else (None, None)
    qd = q.clone().requires_grad_()
    want = dilated_reference(qd, k, v, segs, dils, causal=causal) if dilated else dense_reference(qd, k, v, causal=causal)[0]
    dq = torch.autograd.grad(want, qd, dout)[0]
    for block in (7, 64):
        out, got = sampled_reference(q, k, v, rows, causal=causal, segment_lengths=segs, dilation_rates=dils,
                                     block=block, dtype=torch.float64, dout=dout)
        torch.testing.assert_close(out, want.detach()[:, rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got, dq[:, rows], rtol=1e-10, atol=1e-12)
    qs = q[:, :8].clone().requires_grad_()  # 8 queries on 40 keys ... and 48 queries on 40 keys:
    ql = torch.cat([q, q[:, :8]], 1).requires_grad_()  # rows 0-7 see no key when causal
    for qq in (qs, ql):
        ref = dense_reference(qq, k, v, causal=True)[0]
        do = rand(*ref.shape, gen=gen).double()
        r = torch.tensor([0, 3, qq.shape[1] - 1])
        _, got = sampled_reference(qq.detach(), k, v, r, causal=True, block=16, dtype=torch.float64, dout=do)
        torch.testing.assert_close(got, torch.autograd.grad(ref, qq, do)[0][:, r], rtol=1e-10, atol=1e-12)
