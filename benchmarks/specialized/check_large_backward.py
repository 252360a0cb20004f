"""Gradients of packed causal documents whose batched kernel call crosses 2**31 elements, against
float64 on sampled rows.

The documents of one length share one kernel call (dilated.packed); B documents of 32K rows x 32
heads x 128 make a dq of B * 2**26 elements, past 2**31 from B = 17. Each configuration is run
twice (cuDNN builds its graph at a shape's second call; the first goes to flash) and the second
call's output and dq are checked on rows of the first, middle and last document against a float64
computation of those rows (softmax and its gradient over the document's keys up to the row).

    python benchmarks/specialized/check_large_backward.py --batches 16,17,32
"""
import argparse

import torch

import dilated

L, H, HKV, D = 32768, 32, 8, 128
ROWS = (5, 4097, 20000, L - 1)


def reference_rows(q, k, v, dout, scale):
    """``(out, dq)`` in float64 at rows :data:`ROWS` of one causal document ``[L, H, D]`` (GQA)."""
    g = H // HKV
    found = []
    for i in ROWS:
        keys, values = (x[: i + 1].double().repeat_interleave(g, 1) for x in (k, v))
        p = (torch.einsum("hd,jhd->hj", q[i].double(), keys) * scale).softmax(-1)
        dp = torch.einsum("hd,jhd->hj", dout[i].double(), values)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        found.append((torch.einsum("hj,jhd->hd", p, values), torch.einsum("hj,jhd->hd", ds, keys) * scale))
    return found


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def check(b: int, gen: torch.Generator) -> tuple[float, float]:
    n = b * L
    q, dout = (torch.randn(1, n, H, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, n, HKV, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cu = torch.arange(0, n + 1, L, device="cuda", dtype=torch.int32)
    dilated.attention(q, k, v, causal=True, cu_seqlens=cu).backward(dout)  # first call of the shapes
    q.grad = k.grad = v.grad = None
    out = dilated.attention(q, k, v, causal=True, cu_seqlens=cu)
    out.backward(dout)
    worst_out = worst_dq = 0.0
    for doc in sorted({0, b // 2, b - 1}):
        at = slice(doc * L, (doc + 1) * L)
        for i, (r_out, r_dq) in zip(ROWS, reference_rows(q[0, at].detach(), k[0, at].detach(), v[0, at].detach(),
                                                          dout[0, at], D ** -0.5)):
            worst_out = max(worst_out, rel(out[0, doc * L + i].double(), r_out))
            worst_dq = max(worst_dq, rel(q.grad[0, doc * L + i].double(), r_dq))
    return worst_out, worst_dq


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="16,17,32", help="documents of 32K per call, comma list")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    gen = torch.Generator("cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    for b in (int(x) for x in args.batches.split(",")):
        err_out, err_dq = check(b, gen)
        print(f"{b} documents of {L} x {H}/{HKV} heads x {D}: dq {b * L * H * D / 2**31:.2f} x 2**31 elements; "
              f"out rel err {err_out:.2e}, dq rel err {err_dq:.2e} ({'ok' if err_dq < 3e-2 else 'WRONG'})")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
