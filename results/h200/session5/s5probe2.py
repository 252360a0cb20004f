"""New plan (per-segment in-place diag calls) vs old plan vs floor; combine kernel-only tuning; host enqueue."""
import sys, time, itertools, torch
import dilated.pattern_cache as pc
import dilated.layout as L
from dilated.backends import get_backend
from dilated.functional import default_scale
from dilated.improved_dilated_attention import forward_calls
from dilated.bench.floor import kernel_floor_step
from dilated import ImprovedDilatedAttention

N = int(sys.argv[1])
segs, dils = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
h, d = 16, 128
q, k, v = (torch.randn(1, N, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
impl = get_backend("sdpa_cudnn", q, k, False)
scale = default_scale(d, None)
orig = pc._in_place_form
def old_form(n, count, length, h_, r, diag, batch, mt):
    f = orig(n, count, length, h_, r, diag, batch, mt)
    if f != "per_segment":
        return f
    tiles = batch * count * (h_ // r) * -(-length // (r * 128))
    return "per_offset" if tiles >= mt else None
mt = pc.in_place_min_tiles("cuda")
new_plan = pc.build_plan(N, h, h, segs, dils, "cuda", in_place_tiles=mt)
pc._in_place_form = old_form
old_plan = pc.build_plan(N, h, h, segs, dils, "cuda", in_place_tiles=mt)
pc._in_place_form = orig
print("new plan:", [(c.r, c.mode, c.in_place, c.count) for c in new_plan if c.r > 1 and not (c.mode == "offset" and c.offset)])
print("old plan:", [(c.r, c.mode, c.in_place, c.count) for c in old_plan if c.r > 1 and not (c.mode == "offset" and c.offset)])
variants = {"floor": kernel_floor_step(q, k, v, segs, dils, False, "sdpa_cudnn", "fwd"),
            "new": lambda: forward_calls(q, k, v, new_plan, impl, False, scale, None),
            "old": lambda: forward_calls(q, k, v, old_plan, impl, False, scale, None)}
with torch.no_grad():
    a, b = variants["new"](), variants["old"]()
    print("new vs old max diff", (a[0].float() - b[0].float()).abs().max().item(), (a[1] - b[1]).abs().max().item())
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    def t(f):
        flush.zero_()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); f(); e.record(); e.synchronize(); return s.elapsed_time(e)
    for f in variants.values():
        for _ in range(3): f()
    res = {n: [] for n in variants}
    for rep in range(30):
        for n, f in variants.items():
            res[n].append(t(f))
    fl = sorted(res["floor"])[15]
    for n, ts in res.items():
        ts = sorted(ts); m = ts[15]
        print(f"N={N} {n:6s} median {m:.3f} ms  p10 {ts[3]:.3f} p90 {ts[26]:.3f}  /floor {m/fl:.3f}", flush=True)
    # host enqueue of one module step
    mod = ImprovedDilatedAttention(segs, dils, backend="sdpa_cudnn")
    for _ in range(3): mod(q, k, v)
    hs = []
    for _ in range(10):
        torch.cuda.synchronize(); t0 = time.perf_counter(); mod(q, k, v); hs.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    print(f"N={N} host enqueue of a module step {sorted(hs)[5]:.3f} ms", flush=True)
    # combine, kernel only (20 back-to-back launches between events)
    parts, lses, calls = [], [], []
    out, lse = variants["new"]()
    I = sys.modules["dilated.improved_dilated_attention"]
    cap = {}
    real = I.combine
    def grab(plan, p, l, o, ol=None, **kw):
        cap.update(plan=plan, parts=list(p), lses=list(l) if l is not None else None)
        return real(plan, p, l, o, ol, **kw)
    I.combine = grab
    variants["new"]()
    I.combine = real
    outc = torch.empty_like(q); lsec = torch.empty(1, N, h, device="cuda")
    nbytes = (sum(p.numel() for p in cap["parts"]) + outc.numel()) * 2
    for el, nw in itertools.product([1024, 2048, 4096, 8192], [2, 4, 8]):
        L._LAUNCH.update(elements=el, num_warps=nw)
        f = lambda: L.combine(cap["plan"], cap["parts"], cap["lses"], outc, lsec)
        f(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        ms = []
        for _ in range(5):
            s.record()
            for _ in range(20): f()
            e.record(); e.synchronize(); ms.append(s.elapsed_time(e) / 20)
        m = sorted(ms)[2]
        print(f"N={N} combine elements {el:5d} warps {nw}: {m*1e3:.1f} us {nbytes/m/1e9:.2f} TB/s", flush=True)
    L._LAUNCH.update(elements=4096, num_warps=4)
