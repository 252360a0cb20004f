"""The flash-attn 2, 3 and 4 adapters against CPU stand-ins with the real interfaces.

Each stand-in has the signature of the published function it replaces (flash-attn 2.8's
``flash_attn_interface``, the hopper ``flash_attn_interface`` of 2025, flash-attn 4's
``flash_attn.cute.interface``); the backward functions of flash-attn 2 and 3 are
``torch.library`` custom ops that fill ``dq``, ``dk``, ``dv`` in place, as there. The stand-ins
compute with plain float64 math and take causality only from the flag the real function names
(``causal``, or ``is_causal`` in the hopper backward), so an adapter that drops or misnames an
argument gets a wrong gradient. Outputs and gradients are checked against a float64 reference.
"""
from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
from torch import Tensor

from dilated.backends import flash_attn as fa2_mod
from dilated.backends import flash_attn_3 as fa3_mod
from dilated.backends import flash_attn_4 as fa4_mod
from dilated.backends._signature import call_by_name, parameters
from dilated.reference import dense_reference

from conftest import flash_grads as _grads, rand, rel_err


def _forward(q, k, v, scale, causal):
    """(out in q's dtype, lse [B, H, N] float32), GQA by repeating kv heads."""
    out, lse = dense_reference(q, k, v, causal=causal, scale=scale)
    return out.to(q.dtype), lse.float()


# -- flash-attn 2 (flash_attn/flash_attn_interface.py, 2.7+) ---------------------------------

def fa2_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False):
    out, lse = _forward(q, k, v, softmax_scale, causal)
    return (out, lse, torch.empty(0)) if return_attn_probs else out


@torch.library.custom_op("dilated_standin_fa2::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def fa2_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                 dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor], dropout_p: float,
                 softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                 alibi_slopes: Optional[Tensor], deterministic: bool, rng_state: Optional[Tensor] = None) -> Tensor:
    for dst, g in zip((dq, dk, dv), _grads(dout, q, k, v, out, softmax_lse, softmax_scale, causal)):
        dst.copy_(g)
    return softmax_lse.clone()  # softmax_d in the real op


# -- flash-attn 3 (hopper/flash_attn_interface.py) --------------------------------------------

def fa3_flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    out, lse = _forward(q, k, v, softmax_scale, causal)
    return (out, lse) if return_attn_probs else out


@torch.library.custom_op("dilated_standin_fa3::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def fa3_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                 cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                 sequed_q: Optional[Tensor] = None, sequed_k: Optional[Tensor] = None,
                 max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, dq: Optional[Tensor] = None,
                 dk: Optional[Tensor] = None, dv: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                 is_causal: bool = False, window_size_left: int = -1, window_size_right: int = -1,
                 softcap: float = 0.0, deterministic: bool = False, sm_margin: int = 0) -> Tensor:
    assert cu_seqlens_q is None and sequed_k is None  # dense batches only
    for dst, g in zip((dq, dk, dv), _grads(dout, q, k, v, out, softmax_lse, softmax_scale, is_causal)):
        dst.copy_(g)
    return softmax_lse.clone()


class _FA3Module:
    flash_attn_func = staticmethod(fa3_flash_attn_func)
    _flash_attn_backward = fa3_backward


# -- flash-attn 4 (flash_attn/cute/interface.py) ----------------------------------------------

class _FA4Module:
    @staticmethod
    def _flash_attn_fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        page_table=None, softmax_scale=None, causal=False, softcap=None, window_size_left=None,
                        window_size_right=None, learnable_sink=None, m_block_size=128, n_block_size=128,
                        num_threads=384, pack_gqa=None, return_lse=False, out=None, lse=None):
        o, l = _forward(q, k, v, softmax_scale, causal)
        return o, (l if return_lse else None)

    @staticmethod
    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False, num_stages_Q=2,
                        num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=2,
                        AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False):
        assert q.dtype == out.dtype == dout.dtype, "flash-attn 4 asserts q, out and dout share a dtype"
        return tuple(g.to(t.dtype) for g, t in zip(_grads(dout, q, k, v, out, lse, softmax_scale, causal), (q, k, v)))


ADAPTERS = {
    "flash_attn": (fa2_mod, "FlashAttn2Backend", lambda: (fa2_flash_attn_func, fa2_backward), "_import"),
    "flash_attn_3": (fa3_mod, "FlashAttn3Backend", lambda: _FA3Module, "_import"),
    "flash_attn_4": (fa4_mod, "FlashAttn4Backend", lambda: _FA4Module, "cute_interface"),
}


@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [4, 2])
def test_adapter_forward_and_backward_against_float64(name, causal, hkv, monkeypatch, gen):
    module, cls, standin, loader = ADAPTERS[name]
    monkeypatch.setattr(module, loader, standin)
    backend = getattr(module, cls)()
    q = rand(2, 24, 4, 16, gen=gen)
    k, v = rand(2, 24, hkv, 16, gen=gen), rand(2, 24, hkv, 16, gen=gen)
    scale = 0.3
    out, lse = backend.forward(q, k, v, causal, scale)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = dense_reference(qd, kd, vd, causal=causal, scale=scale)
    assert rel_err(out, ref) < 1e-5 and rel_err(lse, ref_lse) < 1e-5
    dout = rand(*out.shape, gen=gen)
    grads = backend.backward(dout, q, k, v, out, lse, causal, scale)
    for g, rg, x in zip(grads, torch.autograd.grad(ref, (qd, kd, vd), dout.double()), "qkv"):
        assert rel_err(g, rg) < 1e-4, f"d{x}"


def test_flash_attn_4_gets_out_and_dout_in_q_dtype(monkeypatch, gen):
    monkeypatch.setattr(fa4_mod, "cute_interface", lambda: _FA4Module)
    q, k, v = (rand(1, 16, 2, 8, gen=gen) for _ in range(3))
    out, lse = fa4_mod.FlashAttn4Backend().forward(q, k, v, True, 0.35)
    dq, _, _ = fa4_mod.FlashAttn4Backend().backward(rand(1, 16, 2, 8, gen=gen, dtype=torch.float64), q, k, v,
                                                    out.double(), lse, True, 0.35)  # a merged float64 out
    assert dq.dtype == q.dtype


def test_flash_attn_4_compiles_its_backward_variants_once_per_class(monkeypatch, gen):
    """The first long backward of a class also runs calls of every row count in VARIANT_ROWS
    (flash-attn 4 compiles a variant per pair of single-block flags), with GQA as the real call;
    later ones and short ones (the availability probe) do not; the caller's random stream is untouched."""
    rows = []

    class Counting(_FA4Module):
        @staticmethod
        def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False):
            rows.append((q.shape[1], q.shape[2] // k.shape[2], causal))
            return _FA4Module._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal)

    monkeypatch.setattr(fa4_mod, "cute_interface", lambda: Counting)
    backend = fa4_mod.FlashAttn4Backend()
    n = fa4_mod.VARIANT_ROWS[-1] + 1
    q, k, v = rand(1, n, 4, 8, gen=gen), rand(1, n, 2, 8, gen=gen), rand(1, n, 2, 8, gen=gen)

    def backward(causal, rows_=n):
        out, lse = backend.forward(q[:, :rows_], k[:, :rows_], v[:, :rows_], causal, 0.35)
        return backend.backward(torch.ones_like(out), q[:, :rows_], k[:, :rows_], v[:, :rows_], out, lse, causal, 0.35)

    backward(False, 16)
    assert rows == [(16, 2, False)]  # short: nothing more
    rows.clear()
    state = torch.random.get_rng_state()
    backward(False)
    assert rows == [(r, 2, False) for r in fa4_mod.VARIANT_ROWS] + [(n, 2, False)]
    assert torch.equal(torch.random.get_rng_state(), state)
    rows.clear()
    backward(False)
    assert rows == [(n, 2, False)]  # compiled: the real call only
    rows.clear()
    backward(True)  # another class
    assert len(rows) == len(fa4_mod.VARIANT_ROWS) + 1
    monkeypatch.setenv("DILATED_FA4_COMPILE_VARIANTS", "0")
    rows.clear()
    fresh = fa4_mod.FlashAttn4Backend()
    out, lse = fresh.forward(q, k, v, False, 0.35)
    fresh.backward(torch.ones_like(out), q, k, v, out, lse, False, 0.35)
    assert rows == [(n, 2, False)]


def test_parameter_names_come_from_the_schema_of_a_custom_op():
    import inspect

    assert str(inspect.signature(fa3_backward)) == "(*args, **kwargs)"  # what a custom op shows Python
    names = parameters(fa3_backward)
    assert "is_causal" in names and "causal" not in names and names["dq"] and not names["dout"]
    assert list(parameters(torch.ops.dilated_standin_fa2._flash_attn_backward))[:6] == \
        ["dout", "q", "k", "v", "out", "softmax_lse"]


def test_a_function_without_a_required_flag_is_refused_not_called():
    calls = []

    def renamed(q, k, v, softmax_scale=None, mask_kind="none"):
        calls.append(1)

    with pytest.raises(TypeError, match="no parameter named causal or is_causal"):
        call_by_name(renamed, dict(q=1, k=2, v=3, softmax_scale=0.5, causal=True, is_causal=True),
                     required=("q", ("causal", "is_causal")))
    assert not calls
    assert math.isclose(call_by_name(lambda softmax_scale, extra=7: softmax_scale * extra, dict(softmax_scale=0.5)),
                        3.5)


# -- SageAttention (sageattention/core.py: 1.0.6 has no return_lse, 2.x has) ------------------

def sage1_sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True, **kwargs):
    assert tensor_layout == "NHD"  # [B, N, H, D], as dilated passes it
    return _forward(q, k, v, sm_scale, is_causal)[0]


def sage2_sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, **kwargs):
    out, lse = _forward(q, k, v, sm_scale, is_causal)
    return (out, lse) if return_lse else out


@pytest.mark.parametrize("version", ["1.0.6", "2.x"])
def test_sageattention_serves_dense_forward_and_says_when_it_cannot(version, monkeypatch, gen):
    import dilated
    from dilated.backends import sageattention as sage_mod
    from dilated.dense import attention_forward

    monkeypatch.setattr(sage_mod, "_import", lambda: sage1_sageattn if version == "1.0.6" else sage2_sageattn)
    monkeypatch.setattr(sage_mod, "_version", lambda: version)
    backend = sage_mod.SageAttentionBackend()
    q, k, v = (rand(1, 32, 2, 64, gen=gen) for _ in range(3))
    # 1.0.6's non-causal kernel counts padded keys (a partial last block of 64): refused with the reason
    ragged = backend.input_reason(q.half(), k[:, :31].half(), False)
    assert (ragged is not None and "multiple of 64" in ragged) == (version == "1.0.6")
    assert backend.input_reason(q.half(), torch.cat([k, k], 1).half(), False) is None
    assert backend.input_reason(q.half(), k[:, :31].half(), True) is None  # its causal kernel masks them
    for causal in (False, True):
        out, _ = attention_forward(backend, q, k, v, causal, 0.125, need_lse=False)
        assert rel_err(out, dense_reference(q, k, v, causal=causal, scale=0.125)[0]) < 1e-5
    if version == "1.0.6":  # no log-sum-exp: what needs one is refused with the reason
        with pytest.raises(ValueError, match="returns no log-sum-exp"):
            attention_forward(backend, q, k, v, False, 0.125)
        with pytest.raises(ValueError, match="returns no log-sum-exp"):  # causal pieces of seq_q != seq_k merge
            attention_forward(backend, q[:, :8], k, v, True, 0.125, need_lse=False)
    else:
        out, lse = attention_forward(backend, q[:, :8], k, v, True, 0.125)
        ref, ref_lse = dense_reference(q[:, :8], k, v, causal=True, scale=0.125)
        assert rel_err(out, ref) < 1e-5 and rel_err(lse, ref_lse) < 1e-5
    assert backend.input_reason(q.half(), k, True) is None and "head_dim" in backend.input_reason(q[..., :32], k, True)
    with pytest.raises(dilated.BackendUnavailableError):  # on CPU it says why (a CUDA device)
        dilated.attention(q, k, v, backend="sageattention")


def test_a_forward_only_backend_is_refused_for_inputs_that_need_gradients(monkeypatch, gen):
    from dilated.backends import _input_reason, sageattention as sage_mod

    q = rand(1, 16, 2, 64, gen=gen, dtype=torch.bfloat16, requires_grad=True)
    assert "no backward" in _input_reason(sage_mod.SageAttentionBackend(), q, q, q, False)
    with torch.no_grad():
        assert _input_reason(sage_mod.SageAttentionBackend(), q, q, q, False) is None


def _fp8_standin(q, k, v, is_causal=False, scale=None, q_descale=None, k_descale=None, v_descale=None,
                 q_descale_type=0, k_descale_type=0, v_descale_type=0):
    """torch's ``_scaled_dot_product_attention_quantized`` on CPU: e4m3 inputs ``[B, H, N, D]``
    times their per-(batch, head) descale, attention in float64, bfloat16 out."""
    assert q.dtype == k.dtype == v.dtype == torch.float8_e4m3fn
    for x, d in ((q, q_descale), (k, k_descale), (v, v_descale)):
        assert d.shape == x.shape[:2] and d.dtype == torch.float32
    deq = [(x.double() * d.double()[:, :, None, None]).transpose(1, 2) for x, d in ((q, q_descale), (k, k_descale),
                                                                                    (v, v_descale))]
    return dense_reference(*deq, causal=is_causal, scale=scale)[0].transpose(1, 2).to(torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_backend_quantizes_per_head_and_dequantizes_right(causal, monkeypatch, gen):
    import contextlib

    from dilated.backends import sdpa_fp8

    monkeypatch.setattr(sdpa_fp8, "_quantized", lambda: _fp8_standin)
    monkeypatch.setattr(sdpa_fp8, "_fa3_active", contextlib.nullcontext)
    q = rand(2, 32, 4, 16, gen=gen, dtype=torch.bfloat16)
    k = rand(2, 32, 4, 16, gen=gen, dtype=torch.bfloat16) * torch.tensor([1.0, 10.0, 0.1, 3.0]).view(1, 1, 4, 1)
    v = rand(2, 32, 4, 16, gen=gen, dtype=torch.bfloat16)
    k = k.to(torch.bfloat16)
    out, lse = sdpa_fp8.SdpaFp8Backend().forward(q, k, v, causal, 0.25)
    assert lse is None and out.dtype == torch.bfloat16
    # against attention of the e4m3-rounded inputs (each head at its own scale), in float64: what is
    # left is the bf16 output's rounding; a descale applied to the wrong head or batch is far off
    rounded = [(x8.double() * d.double()[:, :, None, None]).transpose(1, 2)
               for x8, d in (sdpa_fp8.quantize(x) for x in (q, k, v))]
    assert rel_err(out, dense_reference(*rounded, causal=causal, scale=0.25)[0]) < 1e-2
    assert rel_err(out, dense_reference(q, k, v, causal=causal, scale=0.25)[0]) < 0.5  # and FP8 error is bounded
    assert sdpa_fp8.SdpaFp8Backend().unavailable_reason(torch.device("cpu")).startswith("FP8 attention needs a CUDA")


def test_fp8_descale_per_batch_and_head():
    from dilated.backends.sdpa_fp8 import E4M3_MAX, quantize

    x = torch.randn(2, 8, 3, 4)
    x[1, :, 2] *= 100  # one (batch, head) far larger: its own scale
    x8, descale = quantize(x)
    assert x8.shape == (2, 3, 8, 4) and descale.shape == (2, 3)
    assert descale[1, 2] == pytest.approx(x[1, :, 2].abs().max().item() / E4M3_MAX)
    back = x8.float() * descale[:, :, None, None]
    assert rel_err(back.transpose(1, 2), x) < 0.07


@pytest.mark.parametrize("d,dv", [(16, 16), (48, 80), (64, 64)])
def test_flash_attn_4_backward_runs_at_head_dims_of_multiples_of_32(d, dv, monkeypatch, gen):
    """flash-attn 4's Hopper backward gives wrong gradients where a head dim is not a multiple of
    32 (dq, and dk, dv with grouped heads; measured on an H200 with 4.0.0b36): the adapter pads q, k
    and v, out, dout with zero columns and cuts the gradients back. The stand-in refuses other head
    dims; the gradients must be float64's, and head dims already multiples of 32 go as they are."""
    seen = []

    class Hopper(_FA4Module):
        @staticmethod
        def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False):
            seen.append((q.shape[-1], v.shape[-1]))
            assert q.shape[-1] % 32 == 0 and v.shape[-1] % 32 == 0, "wrong gradients at these head dims"
            return _FA4Module._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal)

    monkeypatch.setattr(fa4_mod, "cute_interface", lambda: Hopper)
    backend = fa4_mod.FlashAttn4Backend()
    q, k, v = rand(2, 24, 4, d, gen=gen), rand(2, 24, 2, d, gen=gen), rand(2, 24, 2, dv, gen=gen)
    out, lse = backend.forward(q, k, v, True, 0.3)
    dout = rand(*out.shape, gen=gen)
    grads = backend.backward(dout, q, k, v, out, lse, True, 0.3)
    assert seen == [(-(-d // 32) * 32, -(-dv // 32) * 32)]
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = dense_reference(qd, kd, vd, causal=True, scale=0.3)[0]
    for g, rg, x, name in zip(grads, torch.autograd.grad(ref, (qd, kd, vd), dout.double()), (q, k, v), "qkv"):
        assert g.shape == x.shape and rel_err(g, rg) < 1e-4, f"d{name}"
