"""Host cost per call (host-bound loops on small shapes: wall / iterations)."""
import sys, time, torch
import dilated.layout as L
from dilated.backends import get_backend
from dilated.functional import attention_forward, default_scale
from dilated.pattern_cache import build_plan, in_place_min_tiles
from dilated.improved_dilated_attention import forward_calls
aten = torch.ops.aten
N, h, d = 4096, 16, 128
segs, dils = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
q, k, v = (torch.randn(1, N, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
impl = get_backend("sdpa_cudnn", q, k, False)
flash = get_backend("sdpa_flash", q, k, False)
scale = default_scale(d, None)
qs = q[:, :256].transpose(1, 2)
qv = q[:, :512:2, ::2].transpose(1, 2)  # strided
def host(f, iters=300):
    for _ in range(10): f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters): f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / iters * 1e6, (t2 - t0) / iters * 1e6
plan32 = build_plan(32768, h, h, segs, dils, "cuda", in_place_tiles=in_place_min_tiles("cuda"))
Q, K, V = (torch.randn(1, 32768, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
c1 = plan32[1]
cases = {
    "empty_like": lambda: torch.empty_like(q),
    "aten cudnn contiguous": lambda: aten._scaled_dot_product_cudnn_attention(qs, qs, qs, None, True, 0.0, False, False, scale=scale),
    "aten cudnn strided": lambda: aten._scaled_dot_product_cudnn_attention(qv, qv, qv, None, True, 0.0, False, False, scale=scale),
    "aten flash contiguous": lambda: aten._scaled_dot_product_flash_attention(qs, qs, qs, 0.0, False, False, scale=scale),
    "backend.forward cudnn": lambda: impl.forward(q[:, :256], q[:, :256], q[:, :256], False, scale),
    "attention_forward cudnn": lambda: attention_forward(impl, q[:, :256], q[:, :256], q[:, :256], False, scale),
    "gather view (in-place call)": lambda: L.gather(c1, (Q, K, V), (False, True, True)),
}
with torch.no_grad():
    for name, f in cases.items():
        hcost, wall = host(f)
        print(f"{name:32s} host {hcost:7.1f} us/call   wall {wall:7.1f} us/call", flush=True)
    hcost, wall = host(lambda: forward_calls(Q, K, V, plan32, impl, False, scale, None), 30)
    print(f"forward_calls 32K ({len(plan32)} calls)  host {hcost:7.1f} us   wall {wall:7.1f} us", flush=True)
    cap = {}
    mod = sys.modules["dilated.improved_dilated_attention"]
    real = mod.combine
    def grab(plan, p, l, o, ol=None, **kw):
        cap.update(plan=plan, parts=list(p), lses=list(l))
        return real(plan, p, l, o, ol, **kw)
    mod.combine = grab
    forward_calls(Q, K, V, plan32, impl, False, scale, None)
    mod.combine = real
    out, lse = torch.empty_like(Q), torch.empty(1, 32768, h, device="cuda")
    hcost, wall = host(lambda: L.combine(cap["plan"], cap["parts"], cap["lses"], out, lse), 100)
    print(f"combine launch 32K                host {hcost:7.1f} us   wall {wall:7.1f} us", flush=True)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_calls(Q, K, V, plan32, impl, False, scale, None)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    # eager vs CUDA-graph replay, interleaved, L2 flushed
    from dilated.bench.floor import kernel_floor_step
    from dilated import ImprovedDilatedAttention
    mod = ImprovedDilatedAttention(segs, dils, backend="sdpa_cudnn")
    fl = kernel_floor_step(Q, K, V, segs, dils, False, "sdpa_cudnn", "fwd")
    imp = lambda: mod(Q, K, V)
    def graphed(f):
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3): f()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        return g.replay
    variants = {"floor": fl, "improved": imp, "floor_graph": graphed(fl), "improved_graph": graphed(imp)}
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    res = {n: [] for n in variants}
    for f in variants.values():
        for _ in range(3): f()
    for rep in range(30):
        for n, f in variants.items():
            flush.zero_()
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record(); f(); e.record(); e.synchronize(); res[n].append(s.elapsed_time(e))
    for n, ts in res.items():
        ts = sorted(ts)
        print(f"32K {n:15s} median {ts[15]:.3f} ms p10 {ts[3]:.3f} p90 {ts[26]:.3f}", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        variants["floor_graph"](); torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        variants["floor"](); torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
