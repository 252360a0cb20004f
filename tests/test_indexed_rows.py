"""dilated.indexed_rows against float64 computations made here: a merge of partial attention
results equals attention over both key sets; adds round once; repeated slots sum. The torch path
runs here; the Triton kernels in Triton's interpreter (a subprocess: ``TRITON_INTERPRET=1`` is read
when a kernel is defined) and on a GPU where there is one."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dilated import indexed_rows
from dilated.indexed_rows import add_rows_, add_to_slots_, merge_rows_, place_rows_

ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _attend(q, k, v):
    """``(out [B, T, H, D], lse [B, H, T])`` of ``q`` on every key of ``k, v`` (float64)."""
    s = torch.einsum("bthd,bshd->bhts", q, k) / q.shape[-1] ** 0.5
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhts,bshd->bthd", torch.exp(s - lse[..., None]), v), lse


def _merge_case(device, dtype, gen, b=2, n=37, h=3, d=16, t=11):
    """Rows ``rows`` of a ``[B, N, H, D]`` output hold attention over keys A, a part over keys B:
    merged, they are attention over A and B."""
    rows = torch.randperm(n, generator=gen)[:t].to(device)
    q = torch.randn(b, t, h, d, generator=gen, dtype=torch.float64)
    ka, va, kb, vb = (torch.randn(b, m, h, d, generator=gen, dtype=torch.float64) for m in (5, 5, 9, 9))
    oa, la = _attend(q, ka, va)
    ob, lb = _attend(q, kb, vb)
    whole, lw = _attend(q, torch.cat([ka, kb], 1), torch.cat([va, vb], 1))
    out = torch.randn(b, n, h, d, generator=gen, dtype=torch.float64)
    lse = torch.randn(b, h, n, generator=gen, dtype=torch.float64)
    out[:, rows.cpu()] = oa
    lse[:, :, rows.cpu()] = la
    expect, expect_lse = out.clone(), lse.clone()
    expect[:, rows.cpu()] = whole
    expect_lse[:, :, rows.cpu()] = lw
    # lse [B, H, N] as the varlen kernels leave it: a transposed [H, B, N]
    lse_dev = lse.to(torch.float32).transpose(0, 1).contiguous().transpose(0, 1).to(device)
    args = (out.to(device, dtype), lse_dev, rows, ob.to(device, dtype), lb.to(device, torch.float32))
    return args, expect, expect_lse


def check_merge(device, dtype, gen):
    (out, lse, rows, part, part_lse), expect, expect_lse = _merge_case(device, dtype, gen)
    untouched = torch.ones(out.shape[1], dtype=torch.bool)
    untouched[rows.cpu()] = False
    before = out[:, untouched.to(device)].clone()
    merge_rows_(out, lse, rows, part, part_lse)
    torch.testing.assert_close(out.double().cpu(), expect, **TOL[dtype])
    torch.testing.assert_close(lse.double().cpu(), expect_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, untouched.to(device)], before)  # other rows left as they were


def check_add(device, dtype, gen, part_dtype):
    b, n, h, d, t = 2, 29, 2, 24, 9
    rows = torch.randperm(n, generator=gen)[:t].to(device)
    grad = torch.randn(b, n, h, d, generator=gen).to(device, dtype)
    part = torch.randn(b, t, h, d, generator=gen).to(device, part_dtype)
    expect = grad.double().cpu()
    expect[:, rows.cpu()] += part.double().cpu()
    add_rows_(grad, rows, part)
    assert grad.dtype == dtype
    if dtype == part_dtype == torch.float32:  # one rounding of the exact sum: float32's own addition
        assert torch.equal(grad.cpu(), expect.to(dtype))
    else:
        torch.testing.assert_close(grad.double().cpu(), expect, **TOL[dtype])


def check_slots(device, gen):
    """Repeated slots sum; a channel range of a larger buffer (as the gradient rows' buffer is)."""
    b, s, h, dk, dv, t = 2, 13, 2, 8, 16, 21
    slots = torch.randint(0, s, (t,), generator=gen)
    slots[:3] = slots[3]  # a slot four parts add to
    buf = torch.randn(b, s, h, dk + dv, generator=gen).to(device)
    pk = torch.randn(b, t, h, dk, generator=gen).to(device, torch.bfloat16)
    pv = torch.randn(b, t, h, dv, generator=gen).to(device, torch.bfloat16)
    expect = buf.double().cpu()
    for i, slot in enumerate(slots.tolist()):
        expect[:, slot, :, :dk] += pk[:, i].double().cpu()
        expect[:, slot, :, dk:] += pv[:, i].double().cpu()
    add_to_slots_(buf[..., :dk], slots.to(device), pk)
    add_to_slots_(buf[..., dk:], slots.to(device), pv)
    torch.testing.assert_close(buf.double().cpu(), expect, atol=1e-5, rtol=1e-5)


def check_place(device, dtype, gen):
    """Rows placed from a part, or from some of its rows (a padded call's real rows); others untouched."""
    b, n, h, d, t = 2, 31, 3, 40, 12
    rows = torch.randperm(n, generator=gen)[:t]
    dst = torch.randn(b, n, h, d, generator=gen).to(device, dtype)
    src = torch.randn(b, t, h, d, generator=gen).to(device, dtype)
    expect = dst.cpu().clone()
    expect[:, rows] = src.cpu()
    place_rows_(dst, rows.to(device), src)
    assert torch.equal(dst.cpu(), expect)
    padded = torch.randn(b, 2 * t, h, d, generator=gen).to(device, dtype)
    real = torch.randperm(2 * t, generator=gen)[:t]
    expect[:, rows] = padded.cpu()[:, real]
    place_rows_(dst, rows.to(device), padded, real.to(device))
    assert torch.equal(dst.cpu(), expect)
    # a batched call's output [B * C, L, H, D] laid out [B * C, H, L, D] (as kernels return it): C * L rows each
    calls = torch.randn(b * 3, h, 8, d, generator=gen).to(device, dtype).transpose(1, 2)
    real = torch.randperm(24, generator=gen)[:t]
    expect[:, rows] = calls.cpu().reshape(b, 24, h, d)[:, real]
    place_rows_(dst, rows.to(device), calls, real.to(device))
    assert torch.equal(dst.cpu(), expect)
    # into one rank's heads of a [B, N, P * h, D] output (Ulysses' exchanged rows): a strided view of it
    whole = torch.randn(b, n, 2 * h, d, generator=gen).to(device, dtype)
    expect = whole.cpu().clone()
    expect.view(b, n, 2, h, d)[:, rows, 1] = src.cpu()
    place_rows_(whole.view(b, n, 2, h, d)[:, :, 1], rows.to(device), src)
    assert torch.equal(whole.cpu(), expect)


def check_all(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        check_merge(device, dtype, gen)
        check_place(device, dtype, gen)
        for part_dtype in (dtype, torch.float32):
            check_add(device, dtype, gen, part_dtype)
    check_slots(device, gen)


def test_torch_path(monkeypatch):
    monkeypatch.setenv("DILATED_TRITON", "0")
    check_all()


def test_rows_that_are_not_there_change_nothing():
    out = torch.randn(1, 4, 2, 8)
    keep = out.clone()
    none = torch.zeros(0, dtype=torch.int64)
    merge_rows_(out, torch.zeros(1, 2, 4), none, torch.zeros(1, 0, 2, 8), torch.zeros(1, 2, 0))
    add_rows_(out, none, torch.zeros(1, 0, 2, 8))
    assert torch.equal(out, keep)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernels_in_the_interpreter():
    code = ("import torch, test_indexed_rows as t; from dilated import indexed_rows as r; "
            "assert r._on_triton(torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4)); t.check_all(); print('ok')")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_packed_and_document_parallel_attention_on_the_kernels_in_the_interpreter():
    """The callers against float64 with the kernels in Triton's interpreter: packed documents (batched
    calls' rows placed, padded and not, forward and gradients) and document-parallel attention on
    two gloo ranks (the crossing rows merged, added and summed), and non-causal documents in two causal
    halves (their merge and their gradients' sum, :mod:`dilated._triton.causal_halves`)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_packed.py",
                          "tests/parallel/test_distributed.py", "tests/parallel/test_context_parallel.py", "-k",
                          "match_each_document_alone and manual or document_parallel_attention_matches_float64 "
                          "or document_parallel_attention_in_the_kernels_varlen_entry_points or two_causal_halves"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_triton_kernels_on_the_gpu():
    assert indexed_rows._on_triton(torch.zeros(1, 2, 1, 4, device="cuda"), torch.zeros(1, 1, 1, 4, device="cuda"))
    check_all("cuda")
