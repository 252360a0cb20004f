"""Gather and combine (dilated.rows): the Triton kernels against the torch path.

On a CPU machine the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, read
when the kernel is defined, hence the subprocesses); skipped where Triton is not installed.
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dilated
from conftest import rand
from dilated.rows import _combine_torch, branch_view, combine, gather, to_kernel_shape
from dilated.plan import KernelCall, build_plan

ROOT = Path(__file__).resolve().parents[1]
PLANS = [  # (N, H, Hkv, segments, dilations)
    (64, 4, 4, [8, 16], [1, 2]),       # view + diag
    (72, 6, 6, [8, 32], [1, 4]),       # partial last segments, offset calls
    (40, 3, 3, [16, 32], [2, 3]),      # rows no call covers
]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def _interpreted(args):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def check_plans():
    """Run in the interpreter: gather and combine (Triton) equal the torch path."""
    gen = torch.Generator().manual_seed(0)
    runs = [(c, t, 2) for c in PLANS for t in (None, 0)] + [(c, 0, 1) for c in PLANS] + [(None, None, 2)]
    aliased = 0
    for case, in_place, b in runs:  # batch 1: in-place calls of one segment with all offsets
        if case is None:  # what a rank adds for a segment spanning ranks: rows 2::3 of heads 1::3
            n, h = 30, 6
            plan = build_plan(n, h, h, [10], [1], "cpu") + [KernelCall(0, 1, n, 3, "offset", 1, row_offset=2)]
        else:
            n, h, hkv, segs, dils = case
            plan = build_plan(n, h, hkv, segs, dils, "cpu", batch=b, in_place_tiles=in_place)
            assert any(c.in_place for c in plan) == (in_place is not None)
        x = torch.randn(b, n, h, 8, generator=gen)
        y = torch.randn(b, n, 2 * h, 8, generator=gen)[:, :, ::2]  # strided heads
        for c in plan:
            got = gather(c, [x, y.to(torch.bfloat16)])[0]
            for g, t in zip(got, (x, y.to(torch.bfloat16))):
                assert torch.equal(g, to_kernel_shape(branch_view(t, c)))
        parts = [gather(c, [x])[0][0].clone() * (i + 1) for i, c in enumerate(plan)]
        lses = [torch.randn(p.shape[0], p.shape[2], p.shape[1], generator=gen) for p in parts]
        for c in plan:  # in-place calls are views of x, not copies
            assert not c.in_place or gather(c, [x])[0][0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        for dtype in (torch.float32, torch.bfloat16):
            for with_lse in (True, False):
                ps, ls = [p.to(dtype) for p in parts], (lses if with_lse else None)
                got, want = torch.empty_like(x, dtype=dtype), torch.empty_like(x, dtype=dtype)
                got_lse, want_lse = torch.empty(b, n, h), torch.empty(b, n, h)
                combine(plan, ps, ls, got, got_lse if with_lse else None)
                _combine_torch(plan, ps, ls, want, want_lse if with_lse else None, False)
                ulp = 1e-6 if dtype == torch.float32 else 2 ** -7
                torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=2 * ulp * want.abs().max().item())
                if with_lse:
                    torch.testing.assert_close(got_lse, want_lse)  # -inf where no call covers a row
                    alone = combine(plan, ps, ls, torch.empty_like(got))  # the mixture without storing L
                    torch.testing.assert_close(alone, got, rtol=0, atol=0)
                cover = [i for i, c in enumerate(plan) if c.mode == "view" and c.start == 0 and c.count * c.length == n]
                if cover:  # the result overwrites the covering r = 1 part (rows only it covers are skipped)
                    ps[cover[0]] = ps[cover[0]].contiguous()
                    for lse_out in ((got_lse, None) if with_lse else (None,)):
                        aliased_out = ps[cover[0]].clone().view(x.shape)
                        got = combine(plan, [aliased_out.view(ps[cover[0]].shape) if i == cover[0] else p
                                             for i, p in enumerate(ps)], ls, aliased_out, lse_out)
                        torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp,
                                                   atol=2 * ulp * want.abs().max().item())
                        if lse_out is not None:
                            torch.testing.assert_close(lse_out, want_lse)
                    aliased += 1
    assert aliased > 0
    print("plans ok")


@needs_triton
def test_triton_combine_equals_torch_path():
    run = _interpreted(["-c", "import test_rows; test_rows.check_plans()"])
    assert run.returncode == 0 and "plans ok" in run.stdout, run.stdout + run.stderr


@needs_triton
def test_improved_attention_through_triton_combine():
    """The whole improved path (forward and gradients against float64) with the kernel doing the combine."""
    run = _interpreted(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_dilated.py", "tests/test_inputs.py",
                        "-k", "improved and (matches_reference or nan_in_dilated or large_logits or float64)"])
    # incl. the in-place calls; NaN rows and large logits through the kernel's running-max mix
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_combine_writes_in_place_over_the_full_view_part():
    """The result may overwrite the part of an r = 1 call that covers every row (the forward does)."""
    plan = build_plan(32, 4, 4, [8, 16], [1, 2], "cpu")
    x = torch.randn(1, 32, 4, 8)
    parts = [gather(c, [x])[0][0].clone() for c in plan]
    want = torch.empty_like(x)
    _combine_torch(plan, [p.clone() for p in parts], None, want, None, False)
    got = combine(plan, parts, None, parts[0].view(x.shape))
    torch.testing.assert_close(got, want)


class _Launches:
    """Stands in for a Triton kernel: records what would decide its compilation (the grid aside,
    the arguments' kinds: dtype for tensors, values for the rest), runs nothing."""

    def __init__(self):
        self.signatures = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kinds = [(type(a).__name__, a.dtype if isinstance(a, torch.Tensor) else
                      tuple(x.dtype for x in a) if isinstance(a, tuple) else a) for a in args]
            self.signatures.append((tuple(kinds), tuple(sorted(kwargs.items(), key=str))))
        return launch


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_a_new_sequence_length_launches_the_same_kernels(monkeypatch):
    """The plan is data, not compile-time constants: plans of different lengths (tails, in-place
    and gathered calls, diagonal and offset calls) launch gather and combine with one signature."""
    import dilated.rows as rows

    combine_k, gather_k = _Launches(), _Launches()
    monkeypatch.setattr(rows, "_combine_kernel", combine_k)
    monkeypatch.setattr(rows, "_gather_kernel", gather_k)
    monkeypatch.setattr(rows, "_write_addresses", _Launches())
    monkeypatch.setattr(rows, "_TABLES", {})
    for n, tiles in ((256, None), (200, None), (312, 0), (96, 0)):
        plan = build_plan(n, 4, 4, [16, 32, 64], [1, 2, 4], "cpu", in_place_tiles=tiles)
        q = torch.randn(1, n, 4, 8)
        gathered = [c for c in plan if not (c.mode == "view" or c.in_place)]
        for c in gathered:
            views = [to_kernel_shape(branch_view(x, c)) for x in (q, q, q)]
            rows._gather_triton(c, [q, q, q], [torch.empty(v.shape) for v in views])
        parts = [to_kernel_shape(branch_view(q, c)).contiguous() for c in plan]
        lses = [torch.randn(p.shape[0], p.shape[2], p.shape[1]) for p in parts]
        rows._combine_triton(plan, parts, lses, torch.empty_like(q), torch.empty(1, n, 4))
    assert len(combine_k.signatures) == 4 and len(set(combine_k.signatures)) == 1, set(combine_k.signatures)
    assert len(gather_k.signatures) >= 2 and len(set(gather_k.signatures)) == 1, set(gather_k.signatures)
    tables = [t for t in rows._TABLES.values() if t.dim() == 1]  # the plans' and calls' (not the addresses)
    assert len({tuple(t.tolist()) for t in tables}) == len(tables) > 4  # each plan and call its own table


def _compiled(kernel) -> int:
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["sdpa_math", "sdpa_cudnn"])  # gathered, then in-place calls
def test_gpu_new_lengths_compile_nothing_and_capture(backend, gen):
    """On the GPU: after the first lengths, new lengths (forward and backward) compile no gather or
    combine kernel; a forward at yet another length, warmed up then captured in a CUDA graph,
    replays on new inputs to the eager result."""
    import dilated.rows as rows

    segs, dils = [256, 512, 1024], [1, 2, 4]

    def step(n, grad=True):
        q, k, v = (rand(1, n, 8, 64, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_(grad) for _ in range(3))
        out = dilated.improved_dilated_attention(q, k, v, segs, dils, backend=backend)
        if grad:
            out.backward(torch.randn_like(out))
        return q, k, v, out

    for n in (1024, 1000, 1500):  # the kernels' variants: forward, backward, vector widths (by head_dim, strides)
        step(n)
    compiled = _compiled(rows._combine_kernel), _compiled(rows._gather_kernel)
    for n in (2100, 3333, 1111, 2500):
        step(n)
    torch.cuda.synchronize()
    assert (_compiled(rows._combine_kernel), _compiled(rows._gather_kernel)) == compiled, \
        [list(entry[0]) for kernel in (rows._combine_kernel, rows._gather_kernel) for entry in kernel.device_caches.values()]

    q, k, v, _ = step(2900, grad=False)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # a warm-up at this length before the capture, as CUDA graphs need
        dilated.improved_dilated_attention(q, k, v, segs, dils, backend=backend)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the parts' addresses are new here: their tables are made in the capture
        out = dilated.improved_dilated_attention(q, k, v, segs, dils, backend=backend)
    rows._TABLES.clear()  # the graph keeps what it reads
    for _ in range(2):
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        graph.replay()
        want = dilated.improved_dilated_attention(q, k, v, segs, dils, backend=backend)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
