"""Rows of a dilated plan between ``[B, N, H, D]`` and the kernels' shape: gather and combine.

A call ``c`` of a plan (:class:`~dilated.longnet.plan.KernelCall`) covers some rows
``(b, position, head)``; :func:`branch_view` is the strided view of them, laid out
``[B, count, (r,) n, h, ...]``, and a kernel sees them as ``[B', n, h, D]`` (kernel shape).

* :func:`gather`: one call's rows of several ``[B, N, H, D]`` tensors (q, k, v forward; q, k, v,
  out, dout backward) in kernel shape. r = 1 and in-place calls are free (strided) views; the
  others one copy each, on CUDA one Triton launch for all the tensors of the call (whole rows,
  no per-element index arithmetic of a 6-d strided copy).
* :func:`combine`: the result of all calls, each row written once. With lse (forward) it is the
  log-sum-exp mixture ``sum_c exp(lse_c - L) o_c``, ``L = logsumexp_c lse_c`` (LongNet eq. 9-10,
  the merge of :mod:`dilated.merge` for all calls at once), and ``L`` itself; without (gradients)
  the plain sum. On CUDA one Triton kernel reads every call's rows from its kernel-shaped tensor
  and rounds once to the output dtype: no float32 accumulator in memory, no per-branch strided
  merge. The output may alias the part of a ``view`` call covering every row in ``[B, N, H, D]``
  order (each program reads its rows before writing them).

The plan of a whole schedule is combined by :mod:`dilated.longnet.branch_combine`, one kernel per schedule
whatever the length. For other call lists (a rank's share of a distributed schedule, pieces
merged as they go) what a call's rows are (dilation, head offset, segment length when it has
several segments) is compile-time for the kernel (divisions by constants); where they lie (start,
span), the sequence length, tensors and strides are arguments. The gather is compiled per form
(diagonal or one head offset) and heads per call only.
Elsewhere (CPU, GQA kv rows, which select or scatter-add kv heads, no Triton,
``DILATED_TRITON=0``) the same results come from strided views (float32 accumulator for combine).
"""
from __future__ import annotations

import math

import torch

from .._checks import acc_dtype
from .._triton.launch import LAUNCH, blocks, triton_enabled
from .branch_combine import MAX_PERIOD, combine_branches, layout_of
from .memory_pool import MemoryPool
from ..merge import merge_
from .plan import KernelCall

try:  # Triton ships with CUDA builds of PyTorch; it is optional here.
    import triton
    from .._triton.combine import combine_kernel, gather_kernel
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def branch_view(x: torch.Tensor, c: KernelCall, heads: bool = True) -> torch.Tensor:
    """Strided view of ``x`` (``[B, N, H, *rest]``) holding the rows of call ``c``.

    Layout ``[B, count, r, n, h, *rest]`` for "diag", ``[B, count, n, h, *rest]`` otherwise.
    ``heads=False`` selects positions only (kv tensors under GQA).
    """
    s = x[:, c.start:c.start + c.count * c.length].unflatten(1, (c.count, c.length))
    if c.mode == "view":
        return s
    r = c.r
    if c.mode == "diag":
        s = s.unflatten(2, (c.length // r, r)).unflatten(4, (s.shape[3] // r, r))
        return s.diagonal(dim1=3, dim2=5).movedim(-1, 2)
    s = s[:, :, c.first_row::r]
    return s[:, :, :, c.offset::r] if heads else s


def to_kernel_shape(view: torch.Tensor, rest: int = 1) -> torch.Tensor:
    """``[B, count, (r,) n, h, *rest]`` -> ``[B', n, h, *rest]`` (a copy unless already dense)."""
    lead = view.dim() - 2 - rest
    return view.reshape(-1, *view.shape[lead:])


_VIEWS: dict = {}  # (call, shape, strides, rest) -> (size, stride, storage offset) of its kernel view
_MAX_VIEWS = 4096


def kernel_view(x: torch.Tensor, c: KernelCall, rest: int = 1) -> torch.Tensor | None:
    """``to_kernel_shape(branch_view(x, c), rest)`` as one ``as_strided`` of ``x`` when it is a view
    (the geometry is worked out once per call, shape and strides, on a meta tensor: a step's views
    then cost the host one op each instead of a chain of slices); None when it needs a copy."""
    key = (c, tuple(x.shape), x.stride(), rest)
    geometry = _VIEWS.get(key, False)
    if geometry is False:
        meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        v = to_kernel_shape(branch_view(meta, c), rest)
        geometry = (v.shape, v.stride(), v.storage_offset()) if v._base is meta or v is meta else None
        if len(_VIEWS) >= _MAX_VIEWS:
            _VIEWS.clear()
        _VIEWS[key] = geometry
    if geometry is None:
        return None
    return x.as_strided(geometry[0], geometry[1], x.storage_offset() + geometry[2])


def merged_lse_for(lse_rows: torch.Tensor, c: KernelCall) -> torch.Tensor:
    """A row-ordered lse ``[B, N, H]`` at the rows of ``c``, as a kernel's ``[B', h, n]``."""
    rows = kernel_view(lse_rows, c, 0)
    if rows is None:
        rows = to_kernel_shape(branch_view(lse_rows, c), 0)
    return rows.transpose(1, 2).contiguous()


def gather(c: KernelCall, tensors, kv=None, pool: MemoryPool | None = None):
    """The rows of ``c`` of each tensor, in kernel shape. ``kv[i]`` marks kv tensors (GQA calls
    select their kv heads). Returns ``(gathered, buffers)``; the buffers came from ``pool``."""
    if c.mode == "view" or c.in_place:
        views = [kernel_view(x, c) for x in tensors]
        return [to_kernel_shape(branch_view(x, c)) if v is None else v for x, v in zip(tensors, views)], []
    select = [bool(is_kv) and c.kv_heads is not None for is_kv in (kv or [False] * len(tensors))]
    views = [branch_view(x, c, heads=False).index_select(3, c.kv_heads) if sel else branch_view(x, c)
             for x, sel in zip(tensors, select)]
    # an index_select already made its copy: it is the buffer unless the pool provides one
    bufs = [pool.acquire(v.shape, v.dtype, v.device) if pool else
            v if sel else torch.empty(v.shape, dtype=v.dtype, device=v.device) for v, sel in zip(views, select)]
    dense = [to_kernel_shape(buf) for buf in bufs]
    fast = []
    if triton_enabled(tensors[0].device):
        fast = [i for i, (x, sel) in enumerate(zip(tensors, select))
                if not sel and x.stride(-1) == 1 and x.shape == tensors[0].shape]
    if fast:
        _gather_triton(c, [tensors[i] for i in fast], [dense[i] for i in fast])
    for i, (buf, view) in enumerate(zip(bufs, views)):
        if i not in fast and buf is not view:
            buf.copy_(view)
    return dense, (bufs if pool else [])


def combine(plan, parts, lses, out: torch.Tensor, out_lse: torch.Tensor | None = None, *, kv: bool = False):
    """Write the combination of ``parts`` (one per call of ``plan``) into every row of ``out``.

    ``lses``: the calls' kernel lse ``[B', h, n]`` (then ``out_lse``, float32 ``[B, N, H]``, gets
    ``L``; None: a forward nothing differentiates, L is not written) or None for a plain sum.
    ``kv``: the parts are k/v gradients (GQA calls scatter them to their kv heads). Rows no call
    covers get 0 (and lse ``-inf``). Returns ``out``.
    """
    if combines_on_triton(plan, parts, out, kv):
        layout = layout_of(plan, out.shape[1], out.shape[2])
        if layout is not None:  # the kernel of the plan's schedule, the same at every length
            combine_branches(layout, parts, lses, out, out_lse)
        else:
            _combine_triton(plan, parts, lses, out, out_lse)
    else:
        _combine_torch(plan, parts, lses, out, out_lse, kv)
    return out


def combines_on_triton(plan, parts, out: torch.Tensor, kv: bool = False) -> bool:
    """Whether :func:`combine` runs the Triton kernel (one pass, any part may be ``out`` itself)
    rather than torch operations (which accumulate apart from the parts)."""
    gqa = kv and any(c.kv_heads is not None for c in plan)
    return triton_enabled(out.device) and not gqa and out.dtype != torch.float64 \
        and all(p.stride(-1) == 1 for p in parts)


def add_call(acc: torch.Tensor, c: KernelCall, g: torch.Tensor, kv: bool = False) -> None:
    """Add call ``c``'s part ``g`` (kernel shape) into its rows of ``acc`` in place (GQA kv
    gradients to their kv heads): one pass of the combine kernel where it runs."""
    if combines_on_triton([c], [g], acc, kv):  # acc is the first part (it covers every row)
        _combine_triton([KernelCall(0, 1, acc.shape[1], 1, "view"), c], [acc, g], None, acc, None)
    else:
        _add_torch(acc, c, g, kv)


def _add_torch(acc: torch.Tensor, c: KernelCall, g: torch.Tensor, kv: bool) -> None:
    if kv and c.kv_heads is not None:
        view = branch_view(acc, c, heads=False)
        view.index_add_(3, c.kv_heads, g.reshape(*view.shape[:3], -1, acc.shape[-1]).to(acc.dtype))
    else:
        view = branch_view(acc, c)
        view.add_(g.reshape(view.shape))


def merge_call(out: torch.Tensor, out_lse: torch.Tensor, c: KernelCall, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge call ``c``'s result (``o`` in kernel shape, its kernel lse) into its rows of ``out``
    and their lse ``out_lse`` (``[B, N, H]``) in place, where ``out`` holds the mixture of the
    calls merged so far (0 and ``-inf`` where none covered a row yet)."""
    if combines_on_triton([c], [o], out):  # one pass; out is the first part (it covers every row)
        whole = KernelCall(0, 1, out.shape[1], 1, "view")
        _combine_triton([whole, c], [out, o], [out_lse.transpose(1, 2), lse], out, out_lse)
    else:
        rows, view = branch_view(out_lse, c), branch_view(out, c)
        merge_(view, rows, o.reshape(view.shape), lse.transpose(1, 2).reshape(rows.shape))


def _shares_memory(a: torch.Tensor, parts) -> bool:
    return any(a.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in parts)


def _combine_torch(plan, parts, lses, out, out_lse, kv):
    b, n, h, d = out.shape
    acc_type = acc_dtype(out.dtype)
    own = out.dtype == acc_type and not _shares_memory(out, parts)
    acc = out.zero_() if own else out.new_zeros(out.shape, dtype=acc_type)
    if lses is None:
        for c, g in zip(plan, parts):
            _add_torch(acc, c, g, kv)
    else:
        acc_lse = (out_lse if out_lse is not None else out.new_empty(out.shape[:3], dtype=acc_type)).fill_(
            float("-inf"))
        for c, o, lse in zip(plan, parts, lses):
            rows, view = branch_view(acc_lse, c), branch_view(acc, c)
            merge_(view, rows, o.reshape(view.shape), lse.transpose(1, 2).reshape(rows.shape))
    if not own:
        out.copy_(acc)


def _aligned(c: KernelCall) -> int:
    """Segments start at multiples of r: a position's rank mod r says if it is a member."""
    return int(c.start % c.r == 0 and c.length % c.r == 0)


#: The kernels read a call's compile-time constants as a plain tuple, by position (built per step:
#: plain tuples cost the host least): (segment length, or 0 for a call of one segment, r, diag,
#: head offset or -1, first row, aligned), and for the combine two more, (index of its first part,
#: number of parts). Its place, (start, span = count * length), is a runtime argument.
SEGMENT, R, DIAG, OFFSET, FIRST, ALIGNED, PART, SIZE = range(8)


def _call_constants(c: KernelCall) -> tuple:
    """A call's constants in the order of :data:`SEGMENT` ... :data:`ALIGNED`."""
    segment = c.length if c.count > 1 else 0
    if c.mode == "offset":
        return (segment, c.r, 0, c.offset, c.first_row, _aligned(c))
    return (segment, c.r, int(c.mode == "diag"), -1, 0, _aligned(c))


def _place(c: KernelCall) -> tuple:
    """Where a call's rows lie, (start, span): runtime arguments of the kernels."""
    return (c.start, c.count * c.length)




def _period(plan, n: int) -> int:
    """Positions ``t, t + R, t + 2R, ...`` share each aligned call's membership; R = lcm of the
    dilations when small, else 1 (membership is then per row)."""
    period = math.lcm(*(c.r for c in plan))
    return period if period <= min(MAX_PERIOD, n) else 1


def _call_groups(plan, parts, lses, period: int) -> tuple[tuple, tuple]:
    """The combine's calls: ``_call_constants`` + (first part, parts), and their places
    (:func:`_place`, flat). The r calls of one branch
    block, one per head offset (in-place calls), become one call reading the part of its head's
    offset (a pointer chosen per program), when aligned and alike in strides: a program then
    runs one call body per branch instead of r predicated ones."""
    groups, places, i = [], [], 0
    while i < len(plan):
        c, size = plan[i], 1
        if c.mode == "offset" and c.offset == 0 and c.first_row == 0 and period % c.r == 0 \
                and _aligned(c) and i + c.r <= len(plan):
            run = plan[i:i + c.r]
            alike = all(m.mode == "offset" and m.offset == j and m.first_row == j
                        and (m.start, m.count, m.length, m.r) == (c.start, c.count, c.length, c.r)
                        and parts[i + j].stride() == parts[i].stride() and parts[i + j].shape == parts[i].shape
                        and (lses is None or lses[i + j].stride() == lses[i].stride())
                        for j, m in enumerate(run))
            size = c.r if alike else 1
        if size > 1:  # position and head agree mod r, like a diagonal call without the batch fold
            groups.append((_call_constants(c)[SEGMENT], c.r, 0, -1, 0, 1, i, size))
        else:
            groups.append(_call_constants(c) + (i, 1))
        places += _place(c)
        i += size
    return tuple(groups), tuple(places)


def _gather_triton(c, sources, dests):
    d = sources[0].shape[3]
    bp, nc, hc, _ = dests[0].shape
    block_r, block_d = blocks(d)
    gather_kernel[(triton.cdiv(nc * hc, block_r), bp)](
        tuple(sources), tuple(s for x in sources for s in x.stride()[:3]), tuple(dests), nc, d, c.start, c.count,
        c.length, c.r, c.offset if c.mode == "offset" else 0, c.first_row if c.mode == "offset" else 0,
        DIAG=c.mode == "diag", N_T=len(sources), HC=hc, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=LAUNCH["num_warps"])


def _combine_triton(plan, parts, lses, out, out_lse):
    b, n, h, d = out.shape
    has_lse, store_lse = lses is not None, lses is not None and out_lse is not None
    if not parts:
        out.zero_()
        if store_lse:
            out_lse.fill_(float("-inf"))
        return
    # The plan's structure is compile-time (divisions by constants); places, tensors and strides are arguments.
    period = _period(plan, n)
    calls, places = _call_groups(plan, parts, lses, period)
    strides = tuple(s for p in parts for s in p.stride()[:3])
    if has_lse:
        lse_parts, lse_strides = tuple(lses), tuple(s for l in lses for s in l.stride())
    else:
        lse_parts, lse_strides = tuple(parts), strides  # not read
    lse_out, lse_out_strides = (out_lse, out_lse.stride()) if store_lse else (out, (0, 0, 0))  # not written
    block_p, block_d = blocks(d)
    combine_kernel[(triton.cdiv(triton.cdiv(n, period), block_p) * period * h, b)](
        out, lse_out, tuple(parts), strides, lse_parts, lse_strides, places, n, d,
        out.stride(0), out.stride(1), out.stride(2), *lse_out_strides,
        CALLS=calls, N_CALLS=len(calls), H=h, PERIOD=period, HAS_LSE=has_lse, STORE_LSE=store_lse,
        ALIAS=_alias(calls, parts, out), BLOCK_P=block_p, BLOCK_D=block_d, num_warps=LAUNCH["num_warps"])


def _alias(calls, parts, out) -> int:
    """The combine call whose part *is* ``out`` (an r = 1 call covering every row, overwritten in
    place), or -1. Rows no other call covers then already hold their result: the kernel writes
    only their lse (with the nested head offsets of LongNet's schedule, half the rows)."""
    for i, g in enumerate(calls):
        part = parts[g[PART]]
        if g[SIZE] == 1 and g[R] == 1 and part.data_ptr() == out.data_ptr() and part.numel() == out.numel() \
                and part.is_contiguous() and out.is_contiguous():
            return i
    return -1
