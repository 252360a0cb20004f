"""Whether torch's cuDNN attention can run non-causal packed documents padded to bucket lengths, their
padding keys masked by an additive bias: calls of a bounded set of shapes (a bucket length and a
document count), where one call per distinct document length meets a new shape, and so builds a new
cuDNN graph, at nearly every new document mix.

First exactness, forward and backward (autograd through ``F.scaled_dot_product_attention`` on the cuDNN
backend), against every document attended alone in float64, with as many kv heads as q heads and
with GQA; then, Llama-3-8B heads, for documents of a few lengths each padded to its bucket: the padded
call with the bias beside the call of the documents' own length without one (steady, forward; forward
and backward, TFLOP/s on the documents' own pairs), and the padded call's first time at a new mix of
lengths in the same buckets (a graph built again would show there).

    python benchmarks/specialized/probe_cudnn_key_padding.py
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dilated.bench.timing import measure
from dilated.packed import bucket_length


def padded(x: torch.Tensor, lengths, bucket: int) -> torch.Tensor:
    """``[count, bucket, H, D]``: document ``i``'s ``lengths[i]`` rows of ``x [count, >= length, H, D]``,
    zeros after."""
    out = x.new_zeros(len(lengths), bucket, *x.shape[2:])
    for i, m in enumerate(lengths):
        out[i, :m] = x[i, :m]
    return out


def key_bias(lengths, bucket: int, heads: int, dtype, device) -> torch.Tensor:
    """``[count, heads, bucket, bucket]`` (a broadcast view): 0 on each document's keys, -inf on its padding."""
    bias = torch.zeros(len(lengths), 1, 1, bucket, dtype=dtype, device=device)
    for i, m in enumerate(lengths):
        bias[i, ..., m:] = float("-inf")
    return bias.expand(len(lengths), heads, bucket, bucket)


def attend(q, k, v, bias=None):
    """cuDNN attention of ``[B, N, H, D]`` inputs (GQA as given), non-causal, with an additive bias."""
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias,
                                              enable_gqa=k.shape[2] != q.shape[2]).transpose(1, 2)


def exactness(kv_heads: int, device) -> dict:
    """The largest error of the padded, masked call's output and gradients on the documents' rows
    against each document alone in float64."""
    lengths, bucket, heads, d = [900, 1000, 1024], 1024, 8, 128
    gen = torch.Generator(device=device).manual_seed(kv_heads)
    q, k, v = (torch.randn(len(lengths), bucket, h, d, device=device, generator=gen, dtype=torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(len(lengths), bucket, heads, d, device=device, generator=gen, dtype=torch.bfloat16)
    leaves = [padded(x, lengths, bucket).requires_grad_() for x in (q, k, v)]
    out = attend(*leaves, key_bias(lengths, bucket, heads, torch.bfloat16, device))
    grads = torch.autograd.grad(out, leaves, padded(dout, lengths, bucket))
    errors = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0, "dq_scale": 0.0, "dk_scale": 0.0, "dv_scale": 0.0,
              "padding_grads": max(g[i, m:].abs().max().item() for g in grads for i, m in enumerate(lengths)
                                   if m < bucket)}
    rep = heads // kv_heads
    for i, m in enumerate(lengths):
        ref_leaves = [x[i:i + 1, :m].double().requires_grad_() for x in (q, k, v)]
        ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (
            ref_leaves[0], ref_leaves[1].repeat_interleave(rep, 2), ref_leaves[2].repeat_interleave(rep, 2))))
        ref = ref.transpose(1, 2)
        ref_grads = torch.autograd.grad(ref, ref_leaves, dout[i:i + 1, :m].double())
        errors["out"] = max(errors["out"], (out[i:i + 1, :m].double() - ref).abs().max().item())
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
            errors[name] = max(errors[name], (g[i:i + 1, :m].double() - r).abs().max().item())
            errors[name + "_scale"] = max(errors[name + "_scale"], r.abs().max().item())
    return errors


def timed(fn, repeats: int) -> float:
    return statistics.median(measure(fn, torch.device("cuda"), warmup=3, reps=repeats))


def speed(count: int, length: int, repeats: int, device) -> None:
    """Documents of ``length`` rows (``count`` of them) as one call of their own length against the
    same padded to their bucket with the bias: forward, forward and backward."""
    heads, kv_heads, d = 32, 8, 128
    bucket = bucket_length(length)
    gen = torch.Generator(device=device).manual_seed(length)
    q, k, v = (torch.randn(count, length, h, d, device=device, generator=gen, dtype=torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(count, length, heads, d, device=device, generator=gen, dtype=torch.bfloat16)
    lengths = [length] * count
    pq, pk, pv, pdout = (padded(x, lengths, bucket) for x in (q, k, v, dout))
    bias = key_bias(lengths, bucket, heads, torch.bfloat16, device)
    flops = 4 * count * length * length * heads * d
    said = []
    for name, args, g in (("own length", (q, k, v), dout), ("bucket + bias", (pq, pk, pv, bias), pdout)):
        leaves = [x.requires_grad_() for x in args[:3]]
        extra = args[3:]

        def fwd():
            with torch.no_grad():
                attend(*leaves, *extra)

        def fwd_bwd():
            torch.autograd.grad(attend(*leaves, *extra), leaves, g)

        tf, tb = timed(fwd, repeats), timed(fwd_bwd, repeats)
        said.append(f"{name} fwd {tf:.3f} ms ({flops / tf / 1e9:.0f} TFLOP/s), fwd_bwd {tb:.3f} ms "
                    f"({3.5 * flops / tb / 1e9:.0f} TFLOP/s)")
    print(f"{count} x {length} (bucket {bucket}, {100 * (bucket - length) / length:.1f}% padding): " + "; ".join(said))


def new_mix(repeats: int, device) -> None:
    """The padded call's first call at lengths never seen in these buckets (new bias values, the same
    shapes) over its steady time, forward and backward."""
    heads, kv_heads, d = 32, 8, 128
    for lengths in ([9000, 9100], [9050, 8900], [8800, 9200]):
        bucket = bucket_length(max(lengths))
        gen = torch.Generator(device=device).manual_seed(sum(lengths))
        q, k, v = (padded(torch.randn(len(lengths), bucket, h, d, device=device, generator=gen, dtype=torch.bfloat16),
                          lengths, bucket).requires_grad_() for h in (heads, kv_heads, kv_heads))
        dout = padded(torch.randn(len(lengths), bucket, heads, d, device=device, generator=gen, dtype=torch.bfloat16),
                      lengths, bucket)
        bias = key_bias(lengths, bucket, heads, torch.bfloat16, device)

        def call():
            torch.autograd.grad(attend(q, k, v, bias), (q, k, v), dout)

        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        first = (time.perf_counter() - start) * 1e3
        print(f"lengths {lengths} (bucket {bucket}): first call {first:.2f} ms, steady {timed(call, repeats):.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), torch.__version__, "cuDNN", torch.backends.cudnn.version())
    for kv_heads in (8, 2):
        try:
            print(f"exactness, 8 heads, {kv_heads} kv heads, documents of 900, 1000, 1024 rows in 1024:",
                  {n: f"{e:.3g}" for n, e in exactness(kv_heads, device).items()})
        except RuntimeError as e:  # the backend refused the inputs: the probe's answer
            print(f"exactness, {kv_heads} kv heads: cuDNN refused the call: {str(e).splitlines()[0]}")
            return
    for count, length in ((1, 30000), (2, 15000), (4, 7000), (16, 1900)):
        speed(count, length, args.repeats, device)
    new_mix(args.repeats, device)


if __name__ == "__main__":
    main()
