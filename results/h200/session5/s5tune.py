"""Combine kernel only: old grid order (positions fastest) vs new ((t, head) fastest), launch configs."""
import sys, itertools, torch
sys.path.insert(0, "scratch")
import dilated.layout as L
import layout_old as O
from dilated.pattern_cache import build_plan, in_place_min_tiles
segs, dils = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
h, d = 16, 128
for n in [32768, 131072, 1 << 20]:
    plan = build_plan(n, h, h, segs, dils, "cuda", in_place_tiles=in_place_min_tiles("cuda"))
    x = torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16)
    parts = [L.gather(c, [x])[0][0].contiguous().clone() for c in plan]
    lses = [torch.randn(p.shape[0], p.shape[2], p.shape[1], device="cuda") for p in parts]
    out = torch.empty_like(x); lse = torch.empty(1, n, h, device="cuda")
    ref = torch.empty_like(x); ref_lse = torch.empty_like(lse)
    O.combine(plan, parts, lses, ref, ref_lse); L.combine(plan, parts, lses, out, lse)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    nbytes = (sum(p.numel() for p in parts) + out.numel()) * 2
    reps = 20 if n < (1 << 20) else 4
    for el, nw in [(1024, 2), (2048, 4), (4096, 4), (4096, 8), (8192, 8)]:
        row = []
        for mod in (O, L):
            mod._LAUNCH.update(elements=el, num_warps=nw)
            f = lambda: mod.combine(plan, parts, lses, out, lse)
            f(); torch.cuda.synchronize()
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            ms = []
            for _ in range(5):
                s.record()
                for _ in range(reps): f()
                e.record(); e.synchronize(); ms.append(s.elapsed_time(e) / reps)
            m = sorted(ms)[2]
            row.append(f"{m*1e3:8.1f} us {nbytes/m/1e9:.2f} TB/s")
        print(f"N={n:8d} elements {el:5d} warps {nw}: old {row[0]} | new {row[1]}", flush=True)
