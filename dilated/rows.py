"""Rows of a dilated plan between ``[B, N, H, D]`` and the kernels' shape: gather and combine.

A call ``c`` of a plan (:class:`~dilated.plan.KernelCall`) covers some rows
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

The kernels read the plan, the strides and the parts' addresses from a small int64 table on the
device (:func:`_table`), so a new sequence length runs the kernels compiled for any other.
Elsewhere (CPU, GQA kv rows, which select or scatter-add kv heads, no Triton,
``DILATED_TRITON=0``) the same results come from strided views (float32 accumulator for combine).
"""
from __future__ import annotations

import math
import os

import torch

from ._checks import acc_dtype
from .memory_pool import MemoryPool
from .merge import merge_
from .plan import KernelCall

try:  # Triton ships with CUDA builds of PyTorch; it is optional here.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def triton_enabled(device: torch.device) -> bool:
    """Whether gather and combine run Triton kernels on ``device`` (``DILATED_TRITON=0``: never)."""
    if triton is None or os.environ.get("DILATED_TRITON", "1") == "0":
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


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


_VIEWS: dict = {}  # (call, shape, strides) -> (size, stride, storage offset) of its kernel view
_MAX_VIEWS = 4096


def kernel_view(x: torch.Tensor, c: KernelCall) -> torch.Tensor | None:
    """``to_kernel_shape(branch_view(x, c))`` as one ``as_strided`` of ``x`` when it is a view (the
    geometry is worked out once per call, shape and strides, on a meta tensor: a step's views
    then cost the host one op each instead of a chain of slices); None when it needs a copy."""
    key = (c, tuple(x.shape), x.stride())
    geometry = _VIEWS.get(key, False)
    if geometry is False:
        meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        v = to_kernel_shape(branch_view(meta, c))
        geometry = (v.shape, v.stride(), v.storage_offset()) if v._base is meta or v is meta else None
        if len(_VIEWS) >= _MAX_VIEWS:
            _VIEWS.clear()
        _VIEWS[key] = geometry
    if geometry is None:
        return None
    return x.as_strided(geometry[0], geometry[1], x.storage_offset() + geometry[2])


def merged_lse_for(lse_rows: torch.Tensor, c: KernelCall) -> torch.Tensor:
    """A row-ordered lse ``[B, N, H]`` at the rows of ``c``, as a kernel's ``[B', h, n]``."""
    return to_kernel_shape(branch_view(lse_rows, c), 0).transpose(1, 2).contiguous()


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
        _combine_triton(plan, parts, lses, out, out_lse)
    else:
        _combine_torch(plan, parts, lses, out, out_lse, kv)
    return out


def combines_on_triton(plan, parts, out: torch.Tensor, kv: bool = False) -> bool:
    """Whether :func:`combine` runs the Triton kernel (one pass, any part may be ``out`` itself)
    rather than torch operations (which accumulate apart from the parts)."""
    gqa = kv and any(c.kv_heads is not None for c in plan)
    return triton_enabled(out.device) and not gqa and out.dtype in _TL_DTYPES \
        and all(p.stride(-1) == 1 and p.dtype == parts[0].dtype for p in parts) \
        and (not parts or parts[0].dtype in _TL_DTYPES)


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


# per program: rows x head_dim elements. Combine, kernel only, H200, LongNet schedule, D = 128
# (2048 x 4 warps against 4096 x 4): 132 vs 150 us at 32K, 3.53 vs 3.63 ms at 1M.
_LAUNCH = {"elements": 2048, "num_warps": 4}


def _aligned(c: KernelCall) -> int:
    """Segments start at multiples of r: a position's rank mod r says if it is a member."""
    return int(c.start % c.r == 0 and c.length % c.r == 0)


#: A call's constants as the kernels read them (one int64 row of a table, by position):
#: (start, count, length, r, diag, head offset or -1, first row, aligned).
START, COUNT, LENGTH, R, DIAG, OFFSET, FIRST, ALIGNED = range(8)
#: Entries per row of the combine's table: the header, then one row per call (its constants and
#: the strides of its part and of its lse).
ROW = 16


def _call_constants(c: KernelCall) -> tuple:
    """A call's constants in the order of :data:`START` ... :data:`ALIGNED`."""
    aligned = _aligned(c)
    if c.mode == "offset":
        return (c.start, c.count, c.length, c.r, 0, c.offset, c.first_row, aligned)
    return (c.start, c.count, c.length, c.r, int(c.mode == "diag"), -1, 0, aligned)


_MAX_PERIOD = 64  # largest position period of the combine's programs (lcm of the dilations)


def _period(plan, n: int) -> int:
    """Positions ``t, t + R, t + 2R, ...`` share each aligned call's membership; R = lcm of the
    dilations when small, else 1 (membership is then per row)."""
    period = math.lcm(*(c.r for c in plan))
    return period if period <= min(_MAX_PERIOD, n) else 1


_TABLES: dict = {}  # (device, entries) -> the table on the device
_MAX_TABLES = 1024
_CAPTURED: list = []  # tables made or read while a CUDA graph was captured: its replays read them
_CHUNK = 8  # addresses written per launch of _write_addresses


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _kept(key, table, device) -> torch.Tensor:
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.clear()
    _TABLES[key] = table
    if _capturing(device):
        _CAPTURED.append(table)
    return table


def _static_table(key: tuple, entries, device) -> torch.Tensor:
    """What the kernels read of a plan (constants, strides, which calls each program runs), as an
    int64 tensor on ``device``: ``entries()`` (a sequence of ints), made once per ``key`` (the plan
    and the strides) and kept. The plan is data, not compile-time constants: a new sequence length
    compiles nothing."""
    key = (device,) + key
    table = _TABLES.get(key)
    if table is None:
        if _capturing(device):  # an upload now would be a copy from pageable memory inside the graph
            raise RuntimeError("dilated: a CUDA graph captures a call at a length this process has not run "
                               "eagerly; run it once at that length before capturing it (as a warm-up)")
        table = _kept(key, torch.tensor(entries(), dtype=torch.int64, device=device), device)
    elif _capturing(device):
        _CAPTURED.append(table)
    return table


def _vector(elements, tensors, dtype) -> int:
    """Elements per 16-byte access the kernels may assume (``tl.multiple_of``): the largest power
    of two up to 16 bytes dividing every offset in ``elements`` and the tensors' strides but the last."""
    g = math.gcd(*elements, *(x for t in tensors for x in t.stride()[:-1]))
    vec = 16 // dtype.itemsize
    while g % vec:
        vec //= 2
    return vec


def _address_table(parts, lses, device) -> torch.Tensor:
    """``[2, n]`` int64: the parts' and their lses' addresses (n: the calls, rounded up to
    :data:`_CHUNK`), written on the device by :func:`_write_addresses` (a kernel launch: no copy
    from the host, so also while a CUDA graph is captured); kept, since they repeat from step to
    step."""
    lses = lses or parts  # not read
    key = (device, tuple(p.data_ptr() for p in parts), tuple(x.data_ptr() for x in lses))
    table = _TABLES.get(key)
    if table is not None:
        if _capturing(device):
            _CAPTURED.append(table)
        return table
    n = len(parts)
    table = torch.empty(2, -(-n // _CHUNK) * _CHUNK, dtype=torch.int64, device=device)
    for s in range(0, n, _CHUNK):
        chunk = [min(i, n - 1) for i in range(s, s + _CHUNK)]  # the last repeated into the padding
        _write_addresses[(1,)](table[0, s:], table[1, s:], tuple(parts[i] for i in chunk),
                               tuple(lses[i] for i in chunk))
    return _kept(key, table, device)


_TL_DTYPES = {}
if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _blocks(d: int) -> tuple[int, int]:
    """(rows, head_dim padded to a power of two) per program."""
    block_d = triton.next_power_of_2(d)
    return max(1, _LAUNCH["elements"] // block_d), block_d


def _gather_triton(c, sources, dests):
    d = sources[0].shape[3]
    bp, nc, hc, _ = dests[0].shape
    block_r, block_d = _blocks(d)
    strides = tuple(s for x in sources for s in x.stride()[:3])
    entries = _call_constants(c) + (nc, hc, d) + strides
    _gather_kernel[(triton.cdiv(nc * hc, block_r), bp)](
        tuple(sources), tuple(dests), _static_table(entries, lambda: entries, sources[0].device), D=d, N_T=len(sources),
        VEC=_vector([d], list(sources) + list(dests), sources[0].dtype), BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=_LAUNCH["num_warps"])


def _runs(k: tuple, hh: int, t: int, period: int) -> bool:
    """Whether a call (constants ``k``) holds rows of head ``hh`` at positions ``t`` mod ``period``
    (aligned calls: for all of them or none)."""
    r, off, first = k[R], k[OFFSET], k[FIRST]
    if k[ALIGNED] and period % r == 0:
        return (hh % r == off and t % r == first) if off >= 0 else t % r == hh % r
    return off < 0 or hh % r == off


def _shift(x: int) -> int:
    """log2 of a power of two (the kernel then divides by shifting), else -1."""
    return x.bit_length() - 1 if x & (x - 1) == 0 else -1


def _plan_entries(plan, parts, lses, out, out_lse, alias) -> list:
    """The combine's static table: a header (n, d, h, period, the aliased call or -1, calls, the
    output's and the output lse's strides, where the run lists start and their width), one
    :data:`ROW` per call (constants, part strides, lse strides, log2 of length and r where they
    are powers of two), and per program class (position
    mod period, head) the calls that have rows there: a program loops over those only."""
    b, n, h, d = out.shape
    period = _period(plan, n)
    consts = [_call_constants(c) for c in plan]
    width = len(plan) + 1
    entries = [n, d, h, period, alias, len(plan), *out.stride()[:3],
               *(out_lse.stride() if out_lse is not None else (0, 0, 0)), ROW * (len(plan) + 1), width, 0, 0]
    for i, k in enumerate(consts):
        entries += [*k, *parts[i].stride()[:3], *(lses[i].stride() if lses is not None else (0, 0, 0)),
                    _shift(k[LENGTH]), _shift(k[R])]
    for th in range(period * h):
        run = [i for i, k in enumerate(consts) if _runs(k, th % h, th // h, period)]
        entries += [len(run), *run] + [0] * (width - 1 - len(run))
    return entries


def _combine_triton(plan, parts, lses, out, out_lse):
    b, n, h, d = out.shape
    has_lse, store_lse = lses is not None, lses is not None and out_lse is not None
    if not parts:
        out.zero_()
        if store_lse:
            out_lse.fill_(float("-inf"))
        return
    out_lse = out_lse if store_lse else None
    alias = _alias(plan, parts, out)
    key = (tuple(plan), tuple(p.stride() for p in parts), lses is not None and tuple(x.stride() for x in lses),
           out.shape, out.stride(), out_lse is not None and out_lse.stride(), alias)
    table = _static_table(key, lambda: _plan_entries(plan, parts, lses, out, out_lse, alias), out.device)
    size = parts[0].element_size()
    vec = min(_vector([(p.data_ptr() - parts[0].data_ptr()) // size for p in parts], parts, parts[0].dtype),
              _vector([], [out], out.dtype))
    period = _period(plan, n)
    block_p, block_d = _blocks(d)
    _combine_kernel[(triton.cdiv(triton.cdiv(n, period), block_p) * period * h, b)](
        out, out_lse if store_lse else out, parts[0], table, _address_table(parts, lses, out.device),
        D=d, HAS_LSE=has_lse, STORE_LSE=store_lse, VEC=vec, BLOCK_P=block_p,
        BLOCK_D=block_d, num_warps=_LAUNCH["num_warps"])


def _alias(plan, parts, out) -> int:
    """The call whose part *is* ``out`` (an r = 1 call covering every row, overwritten in place),
    or -1. Rows no other call covers then already hold their result: the kernel writes only
    their lse (with the nested head offsets of LongNet's schedule, half the rows)."""
    for i, (c, part) in enumerate(zip(plan, parts)):
        if c.r == 1 and part.data_ptr() == out.data_ptr() and part.numel() == out.numel() \
                and part.is_contiguous() and out.is_contiguous():
            return i
    return -1


if triton is not None:
    from .merge import merge_finish, merge_step

    @triton.jit
    def _write_addresses(part_at, lse_at, parts, lses):
        for k in tl.static_range(8):  # _CHUNK
            tl.store(part_at + k, parts[k].to(tl.int64))
            tl.store(lse_at + k, lses[k].to(tl.int64))

    @triton.jit
    def _call_rows(row, p, pmask, hh, b, period):
        """Rows ``(p, hh)`` of batch ``b`` that the call of table row ``row`` covers, and their
        place in its output (batch index, row, head)."""
        start = tl.load(row + 0).to(tl.int32)
        count = tl.load(row + 1).to(tl.int32)
        length = tl.load(row + 2).to(tl.int32)
        r = tl.load(row + 3).to(tl.int32)
        off = tl.load(row + 5).to(tl.int32)
        first = tl.load(row + 6).to(tl.int32)
        q = p - start
        member = pmask & (q >= 0) & (q < count * length)
        q = tl.where(member, q, 0)
        shift_length = tl.load(row + 14).to(tl.int32)
        shift_r = tl.load(row + 15).to(tl.int32)
        if (shift_length >= 0) & (shift_r >= 0):  # powers of two (LongNet's): shifts, not divisions
            seg = q >> shift_length
            i = q - (seg << shift_length)
            ni = i >> shift_r
            im = i & (r - 1)
        else:
            seg = q // length
            i = q - seg * length
            ni = i // r
            im = i % r
        mh = hh % r
        # where the program's position period decided membership (its run list), any row is in
        per_row = (tl.load(row + 7) == 0) | (period % r != 0)
        member = member & tl.where(per_row, im == tl.where(off >= 0, first, mh), True)
        bi = b * count + seg
        bi = tl.where(tl.load(row + 4) != 0, bi * r + mh, bi)
        return member, bi.to(tl.int64), ni.to(tl.int64), (hh // r).to(tl.int64)

    @triton.jit
    def _lse_rows(row, lse_address, member, bi, ni, hi):
        """The lse of a call (table row ``row``, address at ``lse_address``) at its rows (``-inf``
        off them)."""
        at = tl.load(lse_address).to(tl.pointer_type(tl.float32))
        return tl.load(at + bi * tl.load(row + 11) + hi * tl.load(row + 12) + ni * tl.load(row + 13),
                       mask=member, other=float("-inf"))

    @triton.jit
    def _combine_kernel(out_ptr, out_lse_ptr, part0, table, addresses, D: tl.constexpr, HAS_LSE: tl.constexpr,
                        STORE_LSE: tl.constexpr, VEC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
        # program (block of positions t, t + period, ...; head hh; batch b). Over such positions
        # a head is in an aligned call for all of them or none: a program runs only the calls of
        # its run list (the table's, per (t, hh)). Without STORE_LSE, L is not written (a forward
        # nothing differentiates). Plan and strides: ``table``; the parts' addresses: ``addresses``
        # (read as offsets from ``part0``, multiples of VEC: 16-byte loads).
        n = tl.load(table + 0).to(tl.int32)
        h = tl.load(table + 2).to(tl.int32)
        period = tl.load(table + 3).to(tl.int32)
        alias = tl.load(table + 4).to(tl.int32)
        lse_row = addresses + ((tl.load(table + 5) + 7) // 8) * 8  # the lse addresses (_address_table)
        # (t, hh) vary fastest: programs running together cover one range of positions, all heads
        th = tl.program_id(0) % (period * h)
        blk = tl.program_id(0) // (period * h)
        hh = th % h
        t = th // h
        b = tl.program_id(1)
        p = (blk * BLOCK_P + tl.arange(0, BLOCK_P)) * period + t
        pmask = p < n
        lse_at = out_lse_ptr + b.to(tl.int64) * tl.load(table + 9) + p.to(tl.int64) * tl.load(table + 10) \
            + hh.to(tl.int64) * tl.load(table + 11)
        run = table + tl.load(table + 12) + th * tl.load(table + 13)
        n_run = tl.load(run).to(tl.int32)
        if (alias >= 0) & (n_run == 1) & (tl.load(run + 1) == alias):
            if STORE_LSE:  # only out's own call covers these rows: they hold their result, L is its lse
                row = table + 16 * (alias + 1)
                member, bi, ni, hi = _call_rows(row, p, pmask, hh, b, period)
                tl.store(lse_at, _lse_rows(row, lse_row + alias, member, bi, ni, hi), mask=pmask)
        else:
            _mix(out_ptr, lse_at, part0, table, addresses, lse_row, run, n_run, p, pmask, hh, b, period, D, HAS_LSE,
                 STORE_LSE, VEC, BLOCK_P, BLOCK_D)

    @triton.jit
    def _mix(out_ptr, lse_at, part0, table, addresses, lse_row, run, n_run, p, pmask, hh, b, period,
             D: tl.constexpr, HAS_LSE: tl.constexpr, STORE_LSE: tl.constexpr, VEC: tl.constexpr, BLOCK_P: tl.constexpr,
             BLOCK_D: tl.constexpr):
        """out = sum over the calls of the run list of exp(lse_c - L) o_c, L = logsumexp_c lse_c (or
        the sum of the o_c), and L at ``lse_at`` (``STORE_LSE``), in one pass over the calls (the
        streaming merge of :mod:`dilated.merge`): each call's rows and lse are loaded together, once."""
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
        m_i = tl.full([BLOCK_P], float("-inf"), tl.float32)
        s_i = tl.zeros([BLOCK_P], tl.float32)
        for j in range(n_run):
            c = tl.load(run + 1 + j).to(tl.int32)
            row = table + 16 * (c + 1)
            member, bi, ni, hi = _call_rows(row, p, pmask, hh, b, period)
            base = (tl.load(addresses + c) - part0.to(tl.int64)) // (part0.dtype.element_ty.primitive_bitwidth // 8)
            at = tl.multiple_of(base + bi * tl.load(row + 8) + ni * tl.load(row + 9) + hi * tl.load(row + 10), VEC)
            o = tl.load(part0 + at[:, None] + d[None, :], mask=member[:, None] & dmask[None, :],
                        other=0.0).to(tl.float32)
            if HAS_LSE:
                m_i, s_i, acc = merge_step(m_i, s_i, acc, o, _lse_rows(row, lse_row + c, member, bi, ni, hi))
            else:
                acc += o
        if HAS_LSE:
            acc, lse = merge_finish(m_i, s_i, acc)
            if STORE_LSE:
                tl.store(lse_at, lse, mask=pmask)
        at = tl.multiple_of(b.to(tl.int64) * tl.load(table + 6) + p.to(tl.int64) * tl.load(table + 7)
                            + hh.to(tl.int64) * tl.load(table + 8), VEC)
        tl.store(out_ptr + at[:, None] + d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=pmask[:, None] & dmask[None, :])

    @triton.jit
    def _gather_kernel(sources, dests, table, D: tl.constexpr, N_T: tl.constexpr, VEC: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        # program (row block, kernel batch index bi): rows (ni, hi) of bi, from every source
        start = tl.load(table + 0).to(tl.int32)
        count = tl.load(table + 1).to(tl.int32)
        length = tl.load(table + 2).to(tl.int32)
        r = tl.load(table + 3).to(tl.int32)
        off = tl.load(table + 5).to(tl.int32)
        first = tl.load(table + 6).to(tl.int32)
        nc = tl.load(table + 8).to(tl.int32)
        hc = tl.load(table + 9).to(tl.int32)
        bi = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < nc * hc
        ni = rows // hc
        hi = rows % hc
        if tl.load(table + 4) != 0:  # diagonal
            m = bi % r
            bs = bi // r
            p = start + (bs % count) * length + ni * r + m
            hh = hi * r + m
        else:
            bs = bi
            p = start + (bs % count) * length + ni * r + first
            hh = hi * r + off
        b = bs // count
        d = tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (d < D)[None, :]
        dst = tl.multiple_of((bi.to(tl.int64) * nc * hc + rows.to(tl.int64)) * D, VEC)
        for k in tl.static_range(N_T):
            src = tl.multiple_of(b.to(tl.int64) * tl.load(table + 11 + 3 * k) + p.to(tl.int64) * tl.load(
                table + 12 + 3 * k) + hh.to(tl.int64) * tl.load(table + 13 + 3 * k), VEC)
            x = tl.load(sources[k] + src[:, None] + d[None, :], mask=mask)
            tl.store(dests[k] + dst[:, None] + d[None, :], x, mask=mask)
