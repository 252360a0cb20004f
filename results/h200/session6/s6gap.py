"""Session 6: GPU timeline of one eager 32K forward step as the harness times it (L2 flush, event,
step, event), for ImprovedDilatedAttention and its kernel floor: chrome traces to parse offline."""
import os, torch, dilated
from torch.profiler import profile, ProfilerActivity
from dilated.bench.floor import kernel_floor_step
from dilated.bench.timing import _l2_flusher
segs, dils = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
dev = torch.device("cuda")
q, k, v = (torch.randn(1, 32768, 16, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
mod = dilated.ImprovedDilatedAttention(segs, dils)
floor = kernel_floor_step(q, k, v, segs, dils, False, "auto", "fwd")
flush = _l2_flusher(dev)
steps = {"improved": lambda: mod(q, k, v), "floor": floor}
out = os.environ.get("OUT", ".")
with torch.no_grad():
    for name, step in steps.items():
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                flush()
                a, b = torch.cuda.Event(True), torch.cuda.Event(True)
                a.record(); step(); b.record(); b.synchronize()
                print(name, round(a.elapsed_time(b), 3), "ms", flush=True)
        prof.export_chrome_trace(f"{out}/trace-{name}.json")
