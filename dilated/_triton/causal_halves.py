"""Kernels of :mod:`dilated.causal_halves` (which launches them): the two causal halves of a non-causal
call merged less the diagonal, and their gradients summed less the diagonal's, each in one pass over
the call's rows. Rows ``r`` of ``[R, H, D]`` tensors (a call's ``[B * count, L, H, D]`` rows), lse
``[R / L, H, L]``; the second half's rows are read at ``flip`` (each document reversed within a batch
row of ``T`` rows). One program takes ``BLOCK`` (row, head) pairs (gradients: (row, kv head) pairs,
the ``G`` query heads of each in turn), head_dim on the lanes. Needs Triton."""
import triton
import triton.language as tl


@triton.jit
def _rows(i, T, flip_ptr, pmask):
    """Row ``r`` of each pair and the row the second half holds it at (int64)."""
    r = i.to(tl.int64)
    t = r % T
    r2 = (r - t) + tl.load(flip_ptr + t, mask=pmask, other=0).to(tl.int64)
    return r, r2


@triton.jit
def merge_halves_kernel(out_ptr, lse_ptr, o1_ptr, l1_ptr, o2_ptr, l2_ptr, q_ptr, k_ptr, v_ptr, flip_ptr,
                        R, T, L, H, HKV, D, scale, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[r, h]`` and ``lse`` of row ``r``, head ``h``: ``(e1 o1[r] + e2 o2[flip r] - ed v[r]) / (e1 + e2 - ed)``,
    ``e = exp(x - max(l1, l2))`` of ``l1[r]``, ``l2[flip r]`` and the diagonal logit ``scale q[r] . k[r]``."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pmask = i < R * H
    h = (i % H).to(tl.int64)
    g = h // (H // HKV)
    r, r2 = _rows(i // H, T, flip_ptr, pmask)
    d = tl.arange(0, BLOCK_D)
    both = pmask[:, None] & (d < D)[None, :]
    at = (r * H + h) * D
    at2 = (r2 * H + h) * D
    kv = (r * HKV + g) * D
    qv = tl.load(q_ptr + at[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
    kk = tl.load(k_ptr + kv[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
    vv = tl.load(v_ptr + kv[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
    o1 = tl.load(o1_ptr + at[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
    o2 = tl.load(o2_ptr + at2[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
    lat = ((r // L) * H + h) * L + r % L
    l1 = tl.load(l1_ptr + lat, mask=pmask, other=0.0).to(tl.float32)
    l2 = tl.load(l2_ptr + ((r2 // L) * H + h) * L + r2 % L, mask=pmask, other=0.0).to(tl.float32)
    s = tl.sum(qv * kk, 1) * scale
    top = tl.maximum(l1, l2)
    w1 = tl.exp(l1 - top)
    w2 = tl.exp(l2 - top)
    wd = tl.exp(s - top)
    total = w1 + w2 - wd
    out = (o1 * w1[:, None] + o2 * w2[:, None] - vv * wd[:, None]) / total[:, None]
    tl.store(out_ptr + at[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=both)
    tl.store(lse_ptr + lat, top + tl.log(total), mask=pmask)


@triton.jit
def halves_gradients_kernel(dq_ptr, dk_ptr, dv_ptr, dq2_ptr, dk2_ptr, dv2_ptr, dout_ptr, q_ptr, k_ptr, v_ptr,
                            out_ptr, lse_ptr, dlse_ptr, flip_ptr, R, T, L, H, HKV, D, scale,
                            HAS_DLSE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """In place: ``dq[r, h] += dq2[flip r, h] - scale dS k[r]`` per query head, ``dk[r, g] += dk2[flip r, g]
    - scale sum_h dS q[r, h]`` and ``dv[r, g] += dv2[flip r, g] - sum_h p dout[r, h]`` per kv head ``g``, with
    ``p = exp(scale q[r, h] . k[r, g] - lse)``, ``dS = p (dout . v - dout . out + dlse)``: the second half's
    gradients added to the first's, less the diagonal's share both hold."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pmask = i < R * HKV
    g = (i % HKV).to(tl.int64)
    r, r2 = _rows(i // HKV, T, flip_ptr, pmask)
    d = tl.arange(0, BLOCK_D)
    both = pmask[:, None] & (d < D)[None, :]
    kv = (r * HKV + g) * D
    kv2 = (r2 * HKV + g) * D
    kk = tl.load(k_ptr + kv[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
    vv = tl.load(v_ptr + kv[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
    dk_acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    dv_acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    group = H // HKV
    for j in range(0, group):
        h = g * group + j
        at = (r * H + h) * D
        qv = tl.load(q_ptr + at[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
        do = tl.load(dout_ptr + at[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
        ov = tl.load(out_ptr + at[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
        lat = ((r // L) * H + h) * L + r % L
        lse = tl.load(lse_ptr + lat, mask=pmask, other=0.0).to(tl.float32)
        p = tl.where(pmask, tl.exp(tl.sum(qv * kk, 1) * scale - lse), 0.0)
        ds = tl.sum(do * vv, 1) - tl.sum(do * ov, 1)
        if HAS_DLSE:
            ds += tl.load(dlse_ptr + lat, mask=pmask, other=0.0).to(tl.float32)
        ds = p * ds
        dq = (tl.load(dq_ptr + at[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
              + tl.load(dq2_ptr + ((r2 * H + h) * D)[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
              - kk * (ds * scale)[:, None])
        tl.store(dq_ptr + at[:, None] + d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=both)
        dk_acc += qv * ds[:, None]
        dv_acc += do * p[:, None]
    dk = (tl.load(dk_ptr + kv[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
          + tl.load(dk2_ptr + kv2[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32) - dk_acc * scale)
    dv = (tl.load(dv_ptr + kv[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
          + tl.load(dv2_ptr + kv2[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32) - dv_acc)
    tl.store(dk_ptr + kv[:, None] + d[None, :], dk.to(dk_ptr.dtype.element_ty), mask=both)
    tl.store(dv_ptr + kv[:, None] + d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=both)
