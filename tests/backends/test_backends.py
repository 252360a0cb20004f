"""Every backend available on this machine against the float64 reference."""
import pytest
import torch

import dilated
from dilated.backends import BackendUnavailableError, get_backend
from dilated.reference import dense_reference

from conftest import TOL, rand, rel_err

AVAILABLE = [n for n, r in dilated.available_backends("cpu").items() if r is None]
# On a GPU machine the same checks run for every backend that works there (bf16, as users run it).
CUDA = [("cuda", n, torch.bfloat16) for n, r in dilated.available_backends("cuda").items()
        if r is None] if torch.cuda.is_available() else []
CASES = [("cpu", n, dt) for n in AVAILABLE for dt in (torch.float32, torch.bfloat16)] + CUDA
SHAPES = [  # (B, Nq, Nk, H, Hkv, D)
    (2, 16, 16, 4, 4, 32),
    (1, 1, 1, 2, 2, 16),
    (1, 7, 7, 4, 2, 16),
    (2, 129, 129, 4, 1, 32),
    (1, 7, 129, 4, 2, 16),   # q shorter than k (bottom-right causal)
    (1, 1, 129, 4, 4, 16),   # decode: one query against a KV cache
    (1, 33, 9, 2, 2, 16),    # q longer than k: early causal rows see nothing
    (1, 128, 128, 4, 2, 16), # whole key blocks of 64 (what the quantized kernels take without padding)
]


def test_cpu_has_the_required_backends():
    for name in ("sdpa", "sdpa_math", "manual", "auto"):
        assert name in AVAILABLE, dilated.available_backends("cpu")[name]


@pytest.mark.parametrize("device, backend, dtype", CASES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_backend_matches_float64_reference(device, backend, dtype, shape, causal, gen):
    b, nq, nk, h, hkv, d = shape
    if device == "cuda":
        d = 64  # the fused GPU kernels' common head_dim
    q, k, v = (rand(b, n, hh, d, gen=gen, dtype=dtype).to(device).requires_grad_()
               for n, hh in ((nq, h), (nk, hkv), (nk, hkv)))
    if not get_backend(backend, device=device).supports_backward:
        return check_forward_only(q.detach(), k.detach(), v.detach(), causal, backend)
    out, lse = dilated.attention(q, k, v, causal=causal, backend=backend, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, h, nq)
    ref_out, ref_lse = dense_reference(q.detach(), k.detach(), v.detach(), causal=causal)
    tol = TOL[dtype]
    assert rel_err(out, ref_out) < tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 50 * tol
    # gradients of out and lse together (lse is differentiable too)
    dout = rand(b, nq, h, d, gen=gen, dtype=dtype).to(device)
    dlse = rand(b, h, nq, gen=gen).to(device) * finite
    grads = torch.autograd.grad([out, lse], [q, k, v], [dout, dlse])
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    r_out, r_lse = dense_reference(qd, kd, vd, causal=causal)
    r_lse = torch.where(finite, r_lse, torch.zeros_like(r_lse))
    ref_grads = torch.autograd.grad([r_out, r_lse], [qd, kd, vd], [dout.double(), dlse.double()])
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert g.shape == rg.shape
        assert rel_err(g, rg) < 2 * tol, f"d{name}"


@pytest.mark.parametrize("device, backend, dtype", CUDA, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("d", [16, 20, 48, 80, 112, 256])
def test_gpu_head_dims_other_than_64(device, backend, dtype, d, gen):
    """Head dims a kernel may tile differently from 64 (flash-attn 4's Hopper backward gave wrong dq,
    dk, dv at head dims not a multiple of 32), with grouped heads, causal, rows past one tile:
    forward and gradients against float64, or a BackendUnavailableError that says why (20: the
    fused kernels' own errors were an assertion and "head_size must be a multiple of 8")."""
    q = rand(2, 300, 4, d, gen=gen, dtype=dtype).to(device).requires_grad_()
    k, v = (rand(2, 300, 2, d, gen=gen, dtype=dtype).to(device).requires_grad_() for _ in range(2))
    if not get_backend(backend, device=device).supports_backward:
        pytest.skip(f"{backend} has no backward")
    try:
        get_backend(backend, q, k, True, v=v)  # auto: one that takes these inputs
    except BackendUnavailableError as e:
        assert "head_dim" in str(e)
        with pytest.raises(BackendUnavailableError, match="head_dim"):
            dilated.attention(q, k, v, causal=True, backend=backend)
        return
    out = dilated.attention(q, k, v, causal=True, backend=backend)
    dout = rand(*out.shape, gen=gen, dtype=dtype).to(device)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_reference(qd, kd, vd, causal=True)[0]
    assert rel_err(out, ref) < TOL[dtype]
    for name, g, rg in zip("qkv", grads, torch.autograd.grad(ref, (qd, kd, vd), dout.double())):
        assert rel_err(g, rg) < 2 * TOL[dtype], f"d{name}"


def test_head_dims_a_fused_kernel_cannot_take_are_refused_with_the_fix():
    """flash-attn 4 and torch's fused flash/cuDNN kernels take head dims that are multiples of 8
    up to 256; others get a reason naming head_dim and the fix, not the kernel's own assertion."""
    from dilated.backends.base import head_dim_reason
    from dilated.backends.flash_attn_4 import FlashAttn4Backend

    q = torch.zeros(1, 4, 2, 20, dtype=torch.bfloat16)
    reason = FlashAttn4Backend().input_reason(q, q, False)
    assert "head_dim" in reason and "20" in reason and "24" in reason
    assert FlashAttn4Backend().input_reason(q[..., :16], q[..., :16], False) is None
    assert head_dim_reason(264, "x") is not None and head_dim_reason(256, "x") is None
    assert head_dim_reason(4, "x") is not None


#: max |err| / max |ref| of the quantized kernels (INT8 or FP8 scores), forward only
QUANTIZED_TOL = 6e-2


def check_forward_only(q, k, v, causal, backend):
    """A quantized forward-only kernel: its output against float64 within the quantized tolerance,
    or, where the call needs a log-sum-exp the kernel does not return (causal with seq_q != seq_k
    merges pieces) or keys the kernel cannot take (a partial last key block), the error that says so."""
    try:
        out = dilated.attention(q, k, v, causal=causal, backend=backend)
    except BackendUnavailableError as e:  # a kernel refuses only keys that end in a partial block
        assert k.shape[1] % 64 and "multiple of" in str(e), e
        return
    except ValueError as e:
        assert causal and q.shape[1] != k.shape[1] and "log-sum-exp" in str(e), e
        return
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out, dense_reference(q, k, v, causal=causal)[0]) < QUANTIZED_TOL


def test_explicit_scale(gen):
    q, k, v = (rand(1, 9, 2, 16, gen=gen) for _ in range(3))
    out = dilated.attention(q, k, v, scale=0.3, backend="manual")
    assert rel_err(out, dense_reference(q, k, v, scale=0.3)[0]) < 1e-5


def test_availability_report_gives_reasons():
    report = dilated.available_backends("cpu")
    expected = {"sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex", "flash_attn",
                "flash_attn_3", "flash_attn_4", "xformers", "sageattention", "sdpa_fp8", "manual", "auto"}
    assert set(report) == expected
    for name in ("sdpa_cudnn", "flash_attn", "xformers"):
        assert isinstance(report[name], str) and report[name]


@pytest.mark.parametrize("value, refused", [("1", True), ("true", True), ("0", False), ("", False)])
def test_cudnn_is_not_taken_under_torchs_ragged_graphs_env(value, refused, monkeypatch, gen):
    """TORCH_CUDNN_SDPA_AVOID_RECOMPILE on: sdpa_cudnn is unavailable naming it, and ``sdpa`` takes
    flash where PyTorch would choose cuDNN."""
    from torch.nn.attention import SDPBackend

    from dilated.backends.sdpa import SDPABackend

    monkeypatch.setenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", value)
    reason = SDPABackend("cudnn").unavailable_reason(torch.device("cpu"))
    if refused:
        assert "TORCH_CUDNN_SDPA_AVOID_RECOMPILE" in reason and "unset it" in reason
    else:
        assert "CUDA" in reason and "TORCH_CUDNN_SDPA_AVOID_RECOMPILE" not in reason
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **kw: SDPBackend.CUDNN_ATTENTION.value)
    q = rand(1, 4, 2, 16, gen=gen)
    assert SDPABackend(None)._resolve(q, q, True) == ("flash" if refused else "cudnn")


def test_unavailable_backend_raises_with_reason_and_alternatives(gen):
    q = rand(1, 4, 2, 16, gen=gen)
    with pytest.raises(BackendUnavailableError) as e:
        dilated.attention(q, q, q, backend="sdpa_cudnn")
    msg = str(e.value)
    assert "sdpa_cudnn" in msg and "CUDA" in msg and "manual" in msg


def test_unknown_backend(gen):
    q = rand(1, 4, 2, 16, gen=gen)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        dilated.attention(q, q, q, backend="nope")


@torch.library.custom_op("dilated_test::probe_sdpa_math", mutates_args=())
def _probe_inside_a_custom_op(x: torch.Tensor) -> torch.Tensor:
    import dilated.backends as backends

    reason = backends.backend_reason("sdpa_math", "cpu")
    return x.new_full((1,), 1.0 if reason is None else 0.0)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "custom_op"])
def test_availability_does_not_depend_on_the_callers_grad_mode(mode, monkeypatch):
    """A backend first probed under inference mode or no_grad (an inference server), or inside a
    custom op's implementation (a compiled graph's runtime, where torch turns autograd's dispatch
    off) is as available as one probed with autograd on: the answer is kept for the process.
    sdpa_math's backward goes through autograd."""
    import dilated.backends as backends

    monkeypatch.setattr(backends, "_PROBES", {})  # a fresh probe, not this process's earlier answer
    if mode == "custom_op":
        assert _probe_inside_a_custom_op(torch.zeros(1)).item() == 1.0
    else:
        with getattr(torch, mode)():
            assert backends.backend_reason("sdpa_math", "cpu") is None
    assert ("sdpa_math", "cpu") in backends._PROBES


def test_a_backend_that_imports_but_fails_is_unavailable(gen):
    """Availability comes from a real call: a kernel that raises on use is reported with its error."""
    from dilated.backends import backend_reason, register_backend
    from dilated.backends.base import Backend

    class Broken(Backend):
        name = "broken_for_test"

        def forward(self, q, k, v, causal, scale):
            raise NotImplementedError("No operator found for `memory_efficient_attention_forward`")

    from dilated.backends import _REGISTRY

    register_backend(Broken())
    try:
        reason = backend_reason("broken_for_test", "cpu")
        assert "No operator found" in reason
        assert dilated.available_backends("cpu")["broken_for_test"] == reason
    finally:
        del _REGISTRY["broken_for_test"]


@pytest.mark.parametrize("bad, match, exc", [
    (lambda g: (rand(2, 4, 2, 8, gen=g), rand(3, 4, 2, 8, gen=g), rand(3, 4, 2, 8, gen=g)), "batch", ValueError),
    (lambda g: (rand(1, 4, 2, 8, gen=g), rand(1, 4, 2, 16, gen=g), rand(1, 4, 2, 16, gen=g)), "head_dim", ValueError),
    (lambda g: (rand(1, 4, 3, 8, gen=g), rand(1, 4, 2, 8, gen=g), rand(1, 4, 2, 8, gen=g)), "divisible", ValueError),
    (lambda g: (rand(4, 2, 8, gen=g), rand(4, 2, 8, gen=g), rand(4, 2, 8, gen=g)), "4 dimensions", ValueError),
    (lambda g: (torch.ones(1, 4, 2, 8, dtype=torch.int64),) * 3, "dtype", TypeError),
    (lambda g: (rand(1, 0, 2, 8, gen=g), rand(1, 4, 2, 8, gen=g), rand(1, 4, 2, 8, gen=g)), "empty", ValueError),
    (lambda g: (rand(1, 4, 2, 8, gen=g), rand(1, 4, 2, 8, gen=g), rand(1, 5, 2, 8, gen=g)), "k and v", ValueError),
])
def test_bad_input_names_the_argument(bad, match, exc, gen):
    q, k, v = bad(gen)
    with pytest.raises(exc, match=match):
        dilated.attention(q, k, v)


def test_bad_scale(gen):
    q = rand(1, 4, 2, 8, gen=gen)
    with pytest.raises(ValueError, match="scale"):
        dilated.attention(q, q, q, scale=-1.0)


def test_no_process_wide_settings_change_by_using_the_library(monkeypatch):
    """flex raises dynamo's recompile limits only around its own calls; the library never pins
    glibc's malloc threshold (benchmark programs do)."""
    import torch._dynamo

    from dilated.backends.flex import recompile_limits
    from dilated.bench import memory

    cfg = torch._dynamo.config
    before = cfg.recompile_limit
    with recompile_limits():
        assert cfg.recompile_limit >= 1024
    assert cfg.recompile_limit == before
    monkeypatch.setattr(memory, "_MALLOC_PINNED", False)  # as in a process that ran no benchmark program
    q = torch.randn(1, 16, 2, 8)
    with memory.PeakMemory("cpu"):
        dilated.attention(q, q, q)
    assert not memory.large_allocations_tracked()


def test_backward_slices_keep_each_accumulator_within_its_index_range():
    from dilated.backends.sdpa import FLASH_BACKWARD_MAX
    from dilated.backends.sdpa import backward_slices as flash_backward_slices

    # what was seen on an H200: 512 x 16 heads x 2048 x 128 (exactly 2**31) runs; 15872 x 1 x 2048 x 128 does not
    assert flash_backward_slices(512, 16, 2048, 128) is None
    assert flash_backward_slices(1, 16, 2**20, 128) is None
    for shape, most in [((15872, 1, 2048, 128), None), ((3, 4, 100, 16), 3 * 4 * 128 * 32 - 1),
                        ((1, 16, 2**21, 128), None), ((1, 5, 300, 80), 2 * 384 * 96), ((7, 3, 129, 64), 1)]:
        b, h, n, d = shape
        most = FLASH_BACKWARD_MAX if most is None else most
        each = -(-n // 128) * 128 * (-(-d // 32) * 32)
        if each > most and b == 1:
            with pytest.raises(ValueError, match="flash_attn_4"):
                flash_backward_slices(*shape, most=most)
            continue
        dim, parts = flash_backward_slices(*shape, most=most)
        size = shape[dim]
        assert dim == (0 if b > 1 else 1)
        assert [s for s, _ in parts] == list(range(0, size, parts[0][1])) and sum(n_ for _, n_ in parts) == size
        per = each * (h if dim == 0 else 1)
        if per > most:  # one batch entry is too large: single entries, each sliced by heads next (or refused)
            assert parts[0][1] == 1
            if each > most:
                with pytest.raises(ValueError, match="flash_attn_4"):
                    flash_backward_slices(1, h, n, d, most=most)
            else:
                assert flash_backward_slices(1, h, n, d, most=most)[0] == 1
        else:
            assert all(n_ * per <= most for _, n_ in parts) and (parts[0][1] + 1) * per > most


def test_backward_slices_keep_gqa_groups_whole():
    from dilated.backends.sdpa import backward_slices

    # one batch entry, 8 heads in groups of 4 (2 k/v heads), room for 5 heads: slices of 4 heads
    row = 256 * 64  # one head's dq: 200 rows rounded up to 256, head_dim 64
    assert backward_slices(1, 8, 200, 64, most=5 * row, group=4) == (1, [(0, 4), (4, 4)])
    assert backward_slices(1, 8, 200, 64, most=5 * row, group=1) == (1, [(0, 5), (5, 3)])
    with pytest.raises(ValueError, match="sdpa_cudnn.* 4 head"):  # room for 3 heads: no group of 4 fits
        backward_slices(1, 8, 200, 64, most=3 * row, group=4, kernel="sdpa_cudnn")


@pytest.mark.parametrize("b, most", [(3, 4 * 128 * 32), (1, 2 * 128 * 32)])  # room for 4 heads: 1 batch entry; for 2
def test_a_backward_in_slices_joins_each_slices_gradients(b, most, gen):
    """The sliced backward (GQA: 4 heads on 2 k/v heads) against the float64 gradient of the whole
    call; each slice's kernel stands in as float64 autograd of the dense reference."""
    from dilated.backends.base import to_bhnd
    from dilated.backends.sdpa import _sliced_backward

    q, dout = rand(b, 100, 4, 32, gen=gen, dtype=torch.float64), rand(b, 100, 4, 32, gen=gen, dtype=torch.float64)
    k, v = rand(b, 100, 2, 32, gen=gen, dtype=torch.float64), rand(b, 100, 2, 32, gen=gen, dtype=torch.float64)
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(dense_reference(qd, kd, vd, causal=True)[0], (qd, kd, vd), dout)
    seen = []

    def kernel(dot, qt, kt, vt, ot, lse):  # [B, H, N, D] views in, [B, H, N, D] gradients out
        seen.append((qt.shape[0], qt.shape[1], kt.shape[1]))
        ts = [t.transpose(1, 2).detach().requires_grad_() for t in (qt, kt, vt)]
        out = dense_reference(*ts, causal=True)[0]
        return tuple(to_bhnd(g) for g in torch.autograd.grad(out, ts, dot.transpose(1, 2)))

    args = [to_bhnd(t) for t in (dout, q, k, v, q)] + [torch.zeros(b, 4, 100, dtype=torch.float64)]
    got = _sliced_backward(kernel, most, "a kernel", *args)
    assert len(seen) == (3 if b == 3 else 2) and all(s == (1, 4 if b == 3 else 2, 2 if b == 3 else 1) for s in seen)
    for g, w in zip(got, want):
        assert rel_err(g.transpose(1, 2), w) < 1e-12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend, limit", [("sdpa_flash", "FLASH_BACKWARD_MAX"), ("sdpa_cudnn", "CUDNN_BACKWARD_MAX")])
@pytest.mark.parametrize("b, h", [(3, 4), (1, 4)])  # slices of the batch, then of the heads
def test_gpu_backward_in_slices(b, h, backend, limit, gen, monkeypatch):
    monkeypatch.setattr(f"dilated.backends.sdpa.{limit}", 2 * 256 * 64)
    q, k, v = (rand(b, 200, h, 64, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_() for _ in range(3))
    dout = rand(b, 200, h, 64, gen=gen, dtype=torch.bfloat16).cuda()
    for _ in range(2):  # cuDNN's graph is built at the shape's second call (the first goes to flash)
        out = dilated.attention(q, k, v, causal=True, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_reference(qd, kd, vd, causal=True)[0]
    for g, rg in zip(grads, torch.autograd.grad(ref, (qd, kd, vd), dout.double())):
        assert g.is_contiguous() and rel_err(g, rg) < 2 * TOL[torch.bfloat16]


def test_sdpa_caps_causal_blocks_only_on_cudnn(gen):
    q = rand(1, 16, 2, 8, gen=gen)
    for name in ("sdpa", "sdpa_flash", "sdpa_math"):
        assert get_backend(name, q, q, True).longest_causal_block(q, q) is None  # CPU kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["sdpa_cudnn", "sdpa"])
def test_gpu_cudnn_long_causal_blocks_in_chunks(backend, gen, monkeypatch):
    """cuDNN's causal forward in query chunks (the cap made small) against float64, with gradients."""
    monkeypatch.setattr("dilated.backends.sdpa.CUDNN_LONGEST_CAUSAL_BLOCK", 128)
    q, k, v = (rand(2, 500, 4, 64, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_() for _ in range(3))
    impl = get_backend(backend, q, k, True)
    if impl.longest_causal_block(q, k) is None:
        pytest.skip(f"{backend} does not run cuDNN here")
    assert impl.longest_causal_block(q, k) == 128
    dout = rand(2, 500, 4, 64, gen=gen, dtype=torch.bfloat16).cuda()
    out, lse = dilated.attention(q, k, v, causal=True, backend=backend, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = dense_reference(qd, kd, vd, causal=True)
    assert rel_err(out, ref) < TOL[torch.bfloat16] and rel_err(lse, ref_lse) < 1e-3
    for g, rg in zip(grads, torch.autograd.grad(ref, (qd, kd, vd), dout.double())):
        assert rel_err(g, rg) < 2 * TOL[torch.bfloat16]
