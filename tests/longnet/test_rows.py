"""Gather and combine (dilated.longnet.rows): the Triton kernels against the torch path.

On a CPU machine the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, read
when the kernel is defined, hence the subprocesses); skipped where Triton is not installed.
"""
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from dilated.longnet.rows import _combine_torch, branch_view, combine, gather, to_kernel_shape
from dilated.longnet.plan import KernelCall, build_plan

ROOT = Path(__file__).resolve().parents[2]
PLANS = [  # (N, H, Hkv, segments, dilations)
    (64, 4, 4, [8, 16], [1, 2]),       # view + diag
    (72, 6, 6, [8, 32], [1, 4]),       # partial last segments, offset calls
    (40, 3, 3, [16, 32], [2, 3]),      # rows no call covers
    (83, 8, 8, [8, 32], [1, 8]),       # in place: one call per segment; a last segment not a multiple of r
    (20, 4, 4, [8, 32], [1, 4]),       # a segment longer than the sequence
]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


INTERPRETED = {  # the runs in Triton's interpreter: minutes each, on one core each
    "plans": ["-c", "import test_rows; test_rows.check_plans()"],
    "improved": ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/longnet/test_dilated.py", "tests/test_inputs.py",
                 # float32 only, no GQA: float64 and GQA take the torch combine, not the kernel
                 "-k", "improved and (matches_reference or nan_in_dilated or large_logits) and not dtype1 and not kv2"],
}


_RUNS: dict = {}  # name -> (process, stdout file, stderr file), once started


def start_interpreted() -> None:
    """Start every run of :data:`INTERPRETED` (once): at the lowest priority, so that they take the
    cores the rest of the suite leaves idle (``tests/conftest.py`` starts them when the tests are
    collected; they hold a core each for minutes)."""
    if _RUNS or importlib.util.find_spec("triton") is None:
        return
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}:{ROOT / 'tests' / 'longnet'}")
    logs = Path(tempfile.mkdtemp(prefix="interpreted-"))
    for name, args in INTERPRETED.items():  # output to files: a full pipe would stall a run nobody reads yet
        out, err = open(logs / f"{name}.out", "w+"), open(logs / f"{name}.err", "w+")
        _RUNS[name] = (subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=err, text=True,
                                        preexec_fn=(lambda: os.nice(19)) if hasattr(os, "nice") else None), out, err)


def stop_interpreted() -> None:
    for proc, out, err in _RUNS.values():
        proc.kill()
        proc.wait()
        out.close(), err.close()
    _RUNS.clear()


@pytest.fixture(scope="module")
def interpreted():
    """The runs of :data:`INTERPRETED` (started now if not yet): ``name -> (returncode, stdout, stderr)``."""
    start_interpreted()
    results = {}

    def result(name):
        if name not in results:
            proc, out, err = _RUNS[name]
            try:
                proc.wait(timeout=900)
            finally:
                proc.kill()
            out.seek(0), err.seek(0)
            results[name] = (proc.returncode, out.read(), err.read())
        return results[name]

    yield result
    stop_interpreted()


def check_plans():
    """Run in the interpreter: gather and combine (Triton) equal the torch path, float32 (bf16 on
    two plans); the combine with programs of the default size and of a few rows (on the plan of
    in-place calls) (then a program's rows lie in one segment of
    each branch and the schedule's kernel finds their place once per program)."""
    from dilated._triton.launch import LAUNCH

    _check_plans(PLANS, (torch.float32,))
    # the interpreter is slow: bf16 on one plan and on the in-place calls of another
    _check_plans([PLANS[0]], (torch.bfloat16,), in_place_only=False)
    _check_plans([PLANS[3]], (torch.bfloat16,), in_place_only=True)
    elements = LAUNCH["elements"]
    LAUNCH["elements"] = 32  # 4 rows of head_dim 8 per program (many programs: the in-place plan)
    _check_plans([PLANS[3]], (torch.float32,), in_place_only=True)
    LAUNCH["elements"] = elements
    print("plans ok")


def _check_plans(plans, dtypes, in_place_only: bool | None = None):
    """Each plan gathered and in place (batch 2) and in place at batch 1, and a rank's partial
    plan (``in_place_only=None``); only in place at batch 1 (True); or only the plans (False)."""
    gen = torch.Generator().manual_seed(0)
    runs = [(c, 0, 1) for c in plans]
    if not in_place_only:
        runs = [(c, t, 2) for c in plans for t in (None, 0)] + (runs if in_place_only is None else [])
    if in_place_only is None:
        runs.append((None, None, 2))
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
        for dtype in dtypes:
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
    assert aliased > 0 or in_place_only  # (the in-place plan has no covering r = 1 part)


@needs_triton
def test_triton_combine_equals_torch_path(interpreted):
    code, out, err = interpreted("plans")
    assert code == 0 and "plans ok" in out, out + err


@needs_triton
def test_improved_attention_through_triton_combine(interpreted):
    """The whole improved path (forward and gradients against float64) with the kernel doing the combine."""
    # incl. the in-place calls; NaN rows and large logits through the kernel's running-max mix
    code, out, err = interpreted("improved")
    assert code == 0 and " passed" in out, out[-3000:] + err[-3000:]


def test_combine_writes_in_place_over_the_full_view_part():
    """The result may overwrite the part of an r = 1 call that covers every row (the forward does)."""
    plan = build_plan(32, 4, 4, [8, 16], [1, 2], "cpu")
    x = torch.randn(1, 32, 4, 8)
    parts = [gather(c, [x])[0][0].clone() for c in plan]
    want = torch.empty_like(x)
    _combine_torch(plan, [p.clone() for p in parts], None, want, None, False)
    got = combine(plan, parts, None, parts[0].view(x.shape))
    torch.testing.assert_close(got, want)


def test_in_place_calls_of_a_branch_are_one_combine_call():
    """The r in-place calls of a branch (one per head offset) are read by one call body of the kernel."""
    from dilated.longnet.rows import PART, SIZE, _call_groups

    plan = build_plan(64, 4, 4, [8, 16], [1, 2], "cpu", in_place_tiles=0)
    x = torch.randn(1, 64, 4, 8)
    parts = [gather(c, [x])[0][0].contiguous() for c in plan]
    assert [c.in_place for c in plan] == [False, True, True]
    groups, places = _call_groups(plan, parts, None, period=2)
    assert [(g[PART], g[SIZE]) for g in groups] == [(0, 1), (1, 2)]
    assert places == (0, 64, 0, 64)  # (start, span) of each group
    assert [(g[PART], g[SIZE]) for g in _call_groups(plan, parts, None, period=1)[0]] == [(0, 1), (1, 1), (2, 1)]


class _Compilations:
    """Stands in for a Triton kernel at launch: records what Triton compiles a kernel for (the
    values of its constexpr parameters; for the others, the type and specialization Triton's own
    ``specialize_impl`` gives them: a tensor's dtype and alignment, an int's width and value 1 or
    multiple of 16, inside tuples too), runs nothing."""

    def __init__(self, kernel):
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl

        self.params = kernel.params
        self.keys = []
        self._specialize = lambda x, p: native_specialize_impl(
            BaseBackend, x, False, not p.do_not_specialize, not p.do_not_specialize_on_alignment)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            values = dict(zip((p.name for p in self.params), args), **kwargs)
            self.keys.append(tuple((p.name, values[p.name] if p.is_constexpr else self._specialize(values[p.name], p))
                                   for p in self.params if p.name in values))
        return launch


def _structure(plan):
    from dilated.longnet.rows import _call_constants

    return [(c.mode, c.in_place, _call_constants(c)) for c in plan]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("tiles,lengths", [(None, (200, 268, 340)), (0, (264, 332, 404))])  # gathered, in place
def test_new_lengths_of_one_plan_structure_compile_nothing(monkeypatch, tiles, lengths):
    """Lengths whose plans differ only in where the calls lie (more segments, last segments of
    other lengths, alike mod every r) launch gather and combine with one compilation key each:
    the calls' places, the length and the lse strides are runtime arguments Triton does not
    specialize on."""
    import dilated.longnet.rows as rows

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter has no compilation keys")
    combine_k, gather_k = _Compilations(rows.combine_kernel), _Compilations(rows.gather_kernel)
    monkeypatch.setattr(rows, "combine_kernel", combine_k)
    monkeypatch.setattr(rows, "gather_kernel", gather_k)
    plans = [build_plan(n, 4, 4, [16, 32, 64], [1, 2, 4], "cpu", in_place_tiles=tiles) for n in lengths]
    assert len({str(_structure(p)) for p in plans}) == 1 and len({len(p) for p in plans}) == 1
    assert len({tuple(c.start for c in p) + tuple(c.count for c in p) for p in plans}) == len(lengths)
    for n, plan in zip(lengths, plans):
        q = torch.randn(1, n, 4, 16)  # head_dim a multiple of 16, so is every row stride (as models have it)
        for c in plan:
            if not (c.mode == "view" or c.in_place):
                views = [to_kernel_shape(branch_view(x, c)) for x in (q, q, q)]
                rows._gather_triton(c, [q, q, q], [torch.empty(v.shape) for v in views])
        parts = [to_kernel_shape(branch_view(q, c)).contiguous() for c in plan]
        lses = [torch.randn(p.shape[0], p.shape[2], p.shape[1]) for p in parts]
        rows._combine_triton(plan, parts, lses, torch.empty_like(q), torch.empty(1, n, 4))
        rows._combine_triton(plan, parts, None, torch.empty_like(q), None)
    per_length = len(combine_k.keys) // len(lengths)
    assert len(set(combine_k.keys)) == per_length == 2  # with lse and without, the same at every length
    first = gather_k.keys[:len(gather_k.keys) // len(lengths)]
    assert set(gather_k.keys) == set(first)
    assert (tiles is None) == (len(gather_k.keys) > 0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_lengths_of_any_plan_structure_share_one_combine_kernel(monkeypatch):
    """Plans of one schedule at lengths that change their structure (the number of calls, the
    forms of the last segments, which calls are aligned, gathered or in place) combine with one
    compilation key with lse and one without, and gather with one per form (diagonal or head
    offset) and heads per call."""
    import dilated.longnet.branch_combine as branch_combine
    import dilated.longnet.rows as rows

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter has no compilation keys")
    combine_k, gather_k = _Compilations(branch_combine.branch_combine_kernel), _Compilations(rows.gather_kernel)
    monkeypatch.setattr(branch_combine, "branch_combine_kernel", combine_k)
    monkeypatch.setattr(rows, "gather_kernel", gather_k)
    lengths, forms = (40, 77, 200, 263, 341, 1000, 1001), set()
    structures = set()
    for tiles in (None, 0):
        for n in lengths:
            plan = build_plan(n, 4, 4, [16, 32, 64], [1, 2, 4], "cpu", in_place_tiles=tiles)
            structures.add(str(_structure(plan)))
            q = torch.randn(1, n, 4, 16)
            for c in plan:
                if not (c.mode == "view" or c.in_place):
                    views = [to_kernel_shape(branch_view(x, c)) for x in (q, q, q)]
                    rows._gather_triton(c, [q, q, q], [torch.empty(v.shape) for v in views])
                    forms.add((c.mode, views[0].shape[2]))
            parts = [to_kernel_shape(branch_view(q, c)).contiguous() for c in plan]
            lses = [torch.randn(p.shape[0], p.shape[2], p.shape[1]) for p in parts]
            layout = branch_combine.branch_layout(plan, n, 4)
            assert layout is not None
            branch_combine.combine_branches(layout, parts, lses, torch.empty_like(q), torch.empty(1, n, 4))
            branch_combine.combine_branches(layout, parts, None, torch.empty_like(q), None)
    assert len(structures) > len(lengths)
    assert len(combine_k.keys) == 4 * len(lengths) and len(set(combine_k.keys)) == 2
    assert len(gather_k.keys) > len(forms) == len(set(gather_k.keys))


def _compiled(kernel) -> int:
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA device and Triton")
@pytest.mark.parametrize("backend", ["sdpa_math", "sdpa_cudnn"])  # gathered, then in-place calls
def test_gpu_new_lengths_compile_no_gather_or_combine(backend):
    """On the GPU: once a length with even and one with odd last segments ran (every gather form),
    forward and backward at new lengths, whatever their plans' structure, compile no gather or
    combine kernel."""
    import dilated
    import dilated.longnet.branch_combine as branch_combine
    import dilated.longnet.rows as rows

    segs, dils = [256, 512, 1024], [1, 2, 4]

    def step(n):
        q, k, v = (torch.randn(1, n, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = dilated.improved_dilated_attention(q, k, v, segs, dils, backend=backend)
        out.backward(torch.randn_like(out))

    def compiled():
        return [_compiled(k) for k in (branch_combine.branch_combine_kernel, rows.combine_kernel, rows.gather_kernel)]

    for n in (3172, 3173):
        step(n)
    torch.cuda.synchronize()
    before = compiled()
    assert before[0] > 0  # the combine of the schedule ran
    for n in (4196, 5221, 6243, 7268, 3108, 5157, 9999, 700, 1025):
        step(n)
    torch.cuda.synchronize()
    assert compiled() == before
