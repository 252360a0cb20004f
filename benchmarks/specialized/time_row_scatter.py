"""Placing a batched call's rows back into a packed sequence, four ways, on one GPU: ``out[:, at] = o``
(what the documents path does after each batched call), ``index_copy_``, one slice copy per document,
and the gather (``index_select``) the other direction. 8 documents of 8K rows at scattered places in
128K rows, H=16 and 32, D=128, bf16; median of 30 timed calls after warm-up (CUDA events).

    python benchmarks/specialized/time_row_scatter.py
"""
import statistics

import torch

from dilated.bench.timing import measure


def main() -> None:
    dev = torch.device("cuda")
    for h in (16, 32):
        n = 131072
        out = torch.zeros(1, n, h, 128, device=dev, dtype=torch.bfloat16)
        starts = sorted(torch.randperm(16, generator=torch.Generator().manual_seed(0))[:8].tolist())
        runs = [(s * 8192, 8192) for s in starts]  # 8 documents of 8K at scattered places
        at = torch.cat([torch.arange(a, a + m) for a, m in runs]).to(dev)
        o = torch.randn(1, at.numel(), h, 128, device=dev, dtype=torch.bfloat16)

        def put():
            out[:, at] = o

        def copy_():
            out.index_copy_(1, at, o)

        def slices():
            done = 0
            for a, m in runs:
                out[:, a:a + m].copy_(o[:, done:done + m])
                done += m

        def sel():
            out.index_select(1, at)
        mb = o.numel() * 2 / 2**20
        for name, f in (("index_put", put), ("index_copy_", copy_), ("slice copies", slices),
                        ("index_select (gather)", sel)):
            ms = statistics.median(measure(f, dev, warmup=5, reps=30))
            print(f"H={h} {name}: {ms * 1e3:.1f} us for {mb:.0f} MiB ({2 * mb / 1024 / (ms / 1e3):.0f} GiB/s read+write)")
        put()
        placed = out.clone()
        out.zero_()
        copy_()
        assert torch.equal(placed, out)


if __name__ == "__main__":
    main()
