"""32K overhead probe: kernel timeline of improved vs floor; stream variants."""
import sys, json, os, torch
from torch.profiler import profile, ProfilerActivity
from dilated.backends import get_backend
from dilated.functional import attention_forward, default_scale
from dilated.layout import gather, combine
from dilated.improved_dilated_attention import forward_calls, _result
from dilated.pattern_cache import build_plan, in_place_min_tiles
from dilated.bench.floor import kernel_floor_step

N = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
OUT = sys.argv[2] if len(sys.argv) > 2 else "/tmp"
segs, dils = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
h, d = 16, 128
torch.manual_seed(0)
q, k, v = (torch.randn(1, N, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
impl = get_backend("sdpa_cudnn", q, k, False)
scale = default_scale(d, None)
plans = {"cur": build_plan(N, h, h, segs, dils, "cuda", in_place_tiles=in_place_min_tiles("cuda")),
         "allin": build_plan(N, h, h, segs, dils, "cuda", in_place_tiles=0),
         "gath": build_plan(N, h, h, segs, dils, "cuda")}
side = [torch.cuda.Stream() for _ in range(8)]

def fwd_streams(plan, ns, big_main=True, prio=False):
    main = torch.cuda.current_stream()
    ev = torch.cuda.Event(); ev.record(main)
    streams = side[:ns]
    for s in streams: s.wait_event(ev)
    calls, parts, lses = [], [], []
    j = 0
    for c in plan:
        if c.r == 1 and big_main:
            s = main
        else:
            s = streams[j % ns]; j += 1
        with torch.cuda.stream(s):
            (qb, kb, vb), _ = gather(c, (q, k, v), (False, True, True))
            o, lse = attention_forward(impl, qb, kb, vb, False, scale)
        if s is not main:
            o.record_stream(main); lse.record_stream(main)
        calls.append(c); parts.append(o); lses.append(lse)
    for s in streams:
        e = torch.cuda.Event(); e.record(s); main.wait_event(e)
    out = _result(calls, parts, q, q.dtype)
    out_lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    return combine(calls, parts, lses, out, out_lse)

def calls_only(plan):
    for c in plan:
        (qb, kb, vb), _ = gather(c, (q, k, v), (False, True, True))
        attention_forward(impl, qb, kb, vb, False, scale)

variants = {
    "floor": kernel_floor_step(q, k, v, segs, dils, False, "sdpa_cudnn", "fwd"),
    "cur": lambda: forward_calls(q, k, v, plans["cur"], impl, False, scale, None),
    "allin": lambda: forward_calls(q, k, v, plans["allin"], impl, False, scale, None),
    "cur_calls_only": lambda: calls_only(plans["cur"]),
    "allin_calls_only": lambda: calls_only(plans["allin"]),
    "gath_calls_only": lambda: calls_only(plans["gath"]),
    "cur_s2": lambda: fwd_streams(plans["cur"], 2),
    "cur_s4": lambda: fwd_streams(plans["cur"], 4),
    "allin_s2": lambda: fwd_streams(plans["allin"], 2),
    "allin_s4": lambda: fwd_streams(plans["allin"], 4),
    "allin_s8": lambda: fwd_streams(plans["allin"], 8),
    "allin_s4_all": lambda: fwd_streams(plans["allin"], 4, big_main=False),
}
# correctness of stream variants vs cur
with torch.no_grad():
    ref = variants["cur"]()[0].float()
    for name in ("cur_s4", "allin_s4", "allin"):
        o = variants[name]()
        o = o[0] if isinstance(o, tuple) else o
        print(name, "max diff vs cur", (o.float() - ref).abs().max().item(), flush=True)

def t(f):
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record(); f(); e.record(); e.synchronize(); return s.elapsed_time(e)

with torch.no_grad():
    for f in variants.values():
        for _ in range(3): f()
    torch.cuda.synchronize()
    res = {n: [] for n in variants}
    for rep in range(40):
        for n, f in variants.items():
            res[n].append(t(f))
    fl = sorted(res["floor"])[20]
    for n, ts in res.items():
        ts = sorted(ts); m = ts[len(ts) // 2]
        print(f"N={N} {n:18s} median {m:.3f} ms  p10 {ts[4]:.3f} p90 {ts[35]:.3f}  /floor {m/fl:.3f}", flush=True)
    # profiler timelines
    for name in ("floor", "cur", "allin_s4"):
        f = variants[name]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            f(); torch.cuda.synchronize()
        path = f"{OUT}/trace_{name}_{N}.json"
        prof.export_chrome_trace(path)
        ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        ev.sort(key=lambda e: e["ts"])
        t0 = ev[0]["ts"]; prev = t0
        print(f"--- timeline {name} N={N}")
        for e in ev:
            print(f"  +{e['ts']-t0:8.1f} gap {e['ts']-prev:6.1f} dur {e['dur']:7.1f} s{e.get('args',{}).get('stream','?')} {e['name'][:70]}")
            prev = max(prev, e["ts"] + e["dur"])
        print(f"  span {prev - t0:.1f} us, kernel sum {sum(e['dur'] for e in ev):.1f} us")
