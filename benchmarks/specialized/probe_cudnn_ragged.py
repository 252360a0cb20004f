"""Whether torch's cuDNN attention on ragged (packed) documents can serve packed documents: one call
of ``aten._cudnn_attention_forward`` with ``cum_seq_q``/``cum_seq_k`` (cuDNN's THD layout, what
nested tensors run) in place of the library's batched calls per document length, which build a
cuDNN graph per new call shape.

First exactness, forward and backward (autograd through the op), against every document attended
alone in float64, on a small mix, with as many kv heads as q heads and with GQA; then, on ``N``
positions of each ``--doc-lengths`` mix (``--draws`` new mixes each), Llama-3-8B heads: the ragged
call's first and steady time (forward; forward and backward) beside ``dilated.attention`` on the
same documents (``--backend``, default ``auto``), the harness's CUDA-event timing, the median of
``--repeats`` calls after the first.

    python benchmarks/specialized/probe_cudnn_ragged.py
    python benchmarks/specialized/probe_cudnn_ragged.py --seq-len 1m --doc-lengths "lognormal:8k,1.0" --draws 2
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import dilated
from dilated.bench.documents import cu_seqlens_of
from dilated.bench.sizes import parse_size
from dilated.bench.timing import measure


def ragged(q, k, v, cu: torch.Tensor, longest: int, causal: bool):
    """``(out [T, H, D], lse)`` of one cuDNN call on packed ``[T, H, D]`` rows with documents ``cu``."""
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, longest, longest, True, 0.0, causal, False,
                                                   scale=q.shape[-1] ** -0.5)[:2]


def exactness(kv_heads: int, device) -> dict:
    """The largest error of the ragged call's output and gradients against float64, per document."""
    cu = [0, 100, 357, 1000, 1524, 4096]
    gen = torch.Generator(device=device).manual_seed(kv_heads)
    heads, d = 8, 128
    q, k, v = (torch.randn(cu[-1], h, d, device=device, generator=gen, dtype=torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(cu[-1], heads, d, device=device, generator=gen, dtype=torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, _ = ragged(*leaves, torch.tensor(cu, dtype=torch.int32, device=device),
                    max(b - a for a, b in zip(cu, cu[1:])), True)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    rep = heads // kv_heads
    ref = torch.cat([F.scaled_dot_product_attention(
        ref_leaves[0][a:b].transpose(0, 1), ref_leaves[1][a:b].repeat_interleave(rep, 1).transpose(0, 1),
        ref_leaves[2][a:b].repeat_interleave(rep, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
        for a, b in zip(cu, cu[1:])])
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    errors = {"out": (out.double() - ref).abs().max().item()}
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        errors[name] = (g.double() - r).abs().max().item()
        errors[name + "_scale"] = r.abs().max().item()
    return errors


def timed(fn, repeats: int) -> tuple[float, float]:
    """``(first call ms, steady median ms)``: the first on the host's clock, then ``repeats`` calls by
    the harness's CUDA-event timing (:func:`dilated.bench.timing.measure`)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3, statistics.median(measure(fn, "cuda", warmup=0, reps=repeats))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=parse_size, default=1 << 18)
    parser.add_argument("--doc-lengths", default="lognormal:8k,1.0;lognormal:1k,1.0")
    parser.add_argument("--draws", type=int, default=4, help="new mixes of each spec (#0, #1, ...)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default="auto", help="the library's backend beside the ragged call")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_cudnn_ragged needs a CUDA GPU")
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    for kv_heads in (8, 2):
        e = exactness(kv_heads, device)
        verdict = "exact" if all(e[n] < 0.05 * max(1.0, e.get(n + "_scale", 1.0)) for n in ("out", "dq", "dk", "dv")) \
            else "WRONG"
        print(f"8 q heads, {kv_heads} kv heads: max |error| out {e['out']:.4f}, dq {e['dq']:.4f} "
              f"(of {e['dq_scale']:.2f}), dk {e['dk']:.4f} (of {e['dk_scale']:.2f}), dv {e['dv']:.4f} "
              f"(of {e['dv_scale']:.2f}): {verdict}")
    n, heads, kv_heads, d = args.seq_len, 32, 8, 128
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(n, h, d, device=device, generator=gen, dtype=torch.bfloat16, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    print(f"N={n}, heads {heads}/{kv_heads}/{d}, causal; ms, first call / steady median of {args.repeats}")
    for spec in args.doc_lengths.split(";"):
        for draw in range(args.draws):
            cu = cu_seqlens_of(f"{spec}#{draw}", n)
            cu_gpu = torch.tensor(cu, dtype=torch.int32, device=device)
            longest = max(b - a for a, b in zip(cu, cu[1:]))

            def forward():
                ragged(q.detach(), k.detach(), v.detach(), cu_gpu, longest, True)

            def both():
                out, _ = ragged(q, k, v, cu_gpu, longest, True)
                out.backward(torch.ones_like(out))

            def library():
                out = dilated.attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=True,
                                        backend=args.backend, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
                out.backward(torch.ones_like(out))

            rows = [timed(fn, args.repeats) for fn in (forward, both, library)]
            print(f"{spec}#{draw} ({len(cu) - 1} documents): ragged fwd {rows[0][0]:.1f} / {rows[0][1]:.1f}, "
                  f"ragged fwd_bwd {rows[1][0]:.1f} / {rows[1][1]:.1f}; dilated.attention ({args.backend}) fwd_bwd "
                  f"{rows[2][0]:.1f} / {rows[2][1]:.1f}", flush=True)


if __name__ == "__main__":
    main()
