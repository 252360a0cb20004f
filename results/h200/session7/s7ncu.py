"""For ncu: the combine at 32K once each: session 6 kernel, now with L stored, now without (after a warm-up of each)."""
import sys, torch
sys.path.insert(0, "scratch")
import dilated.layout as L
import layout_s6 as O
from dilated.pattern_cache import build_plan, in_place_min_tiles
segs, dils = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
n, h, d = 32768, 16, 128
plan = build_plan(n, h, h, segs, dils, "cuda", in_place_tiles=in_place_min_tiles("cuda"))
x = torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16)
parts = [L.gather(c, [x])[0][0].contiguous().clone() for c in plan]
lses = [torch.randn(p.shape[0], p.shape[2], p.shape[1], device="cuda") for p in parts]
lse = torch.empty(1, n, h, device="cuda")
out = parts[0].view(x.shape)
fs = [lambda: O.combine(plan, parts, lses, out, lse), lambda: L.combine(plan, parts, lses, out, lse),
      lambda: L.combine(plan, parts, lses, out)]
for f in fs:  # warm-up (compiles): launches 1-3
    f()
torch.cuda.synchronize()
for f in fs:  # profiled: launches 4-6
    f()
torch.cuda.synchronize()
print("done")
