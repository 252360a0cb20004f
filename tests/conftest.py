import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# tests that name sdpa_cudnn test cuDNN: its first call at a shape builds the graph (the deferred
# build has tests of its own, which set it)
os.environ.setdefault("DILATED_CUDNN_BUILD_AFTER", "1")
# the scripts and torchrun workers the tests start import this checkout, installed or not
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a process group's or a daemon's)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(fn, args, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)``, the ranks forked from this
    process where it has not started CUDA (a forked child cannot use a CUDA context its parent
    made): they start with its imports instead of importing torch again each, seconds a rank."""
    import torch.multiprocessing as mp

    fork = "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="fork" if fork else "spawn")


def cpu_only_env(**extra) -> dict:
    """The environment of a child process that tests a machine without GPUs (the CPU defaults), on
    any host, with ``extra`` variables (a ``PYTHONPATH`` goes in front of the checkout's)."""
    if "PYTHONPATH" in extra:
        extra["PYTHONPATH"] = os.pathsep.join(p for p in (extra["PYTHONPATH"], os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", **extra}


def usage_error(main, argv) -> tuple[int, str]:
    """``(exit status, stderr)`` of a benchmark script's ``main`` on ``argv``, in this process (usage
    errors come before any work; ``test_usage_errors_in_a_real_process_leave_no_file`` runs one in a
    real process)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main(argv)
    return stop.value.code, err.getvalue()


@pytest.fixture
def gen():
    """A fresh seeded generator per test: random inputs, never zeros."""
    return torch.Generator().manual_seed(1234)


def rand(*shape, gen, dtype=torch.float32, scale=1.0, requires_grad=False):
    x = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    return x.requires_grad_(requires_grad)


# tolerances on max |err| / max |ref| per dtype (outputs and gradients)
TOL = {torch.float64: 1e-5, torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-3)).item()


GPU_CASE = 1000, [128, 256, 512], [1, 2, 4]  # N, segments, dilations of the GPU checks


def check_gpu_bf16(fn, causal, gen):
    """``fn(q, k, v, segments, dilations)`` in bf16 on the GPU against float64: output and gradients."""
    from dilated.reference import dilated_reference

    n, segs, dils = GPU_CASE
    q, k, v = (rand(1, n, 8, 64, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_() for _ in range(3))
    out = fn(q, k, v, segs, dils)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dilated_reference(qd, kd, vd, segs, dils, causal)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    dout = rand(1, n, 8, 64, gen=gen, dtype=torch.bfloat16).cuda()
    for g, rg in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (qd, kd, vd), dout.double())):
        assert rel_err(g, rg) < 2 * TOL[torch.bfloat16]


def flash_grads(dout, q, k, v, out, lse, scale, causal, dlse=None):
    """dq, dk, dv from the saved out and lse ``[B, H, N]`` (a flash backward's contract), in float64;
    GQA by kv head groups; ``dlse``: a gradient of lse as well (it adds ``P * dlse`` to ``dS``)."""
    b, n, h, d = q.shape
    g = h // k.shape[2]
    qd, kd, vd = (t.double() for t in (q, k, v))
    kd, vd = kd.repeat_interleave(g, 2), vd.repeat_interleave(g, 2)
    s = torch.einsum("bnhd,bmhd->bhnm", qd, kd) * scale
    if causal:
        s = s.masked_fill(torch.ones(n, k.shape[1], dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - lse.double().unsqueeze(-1))
    do = dout.double()
    dv = torch.einsum("bhnm,bnhd->bmhd", p, do)
    dp = torch.einsum("bnhd,bmhd->bhnm", do, vd)
    delta = (do * out.double()).sum(-1).transpose(1, 2).unsqueeze(-1)
    if dlse is not None:
        delta = delta - dlse.double().unsqueeze(-1)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhnm,bmhd->bnhd", ds, kd)
    dk = torch.einsum("bhnm,bnhd->bmhd", ds, qd)
    hk = k.shape[2]
    return dq, dk.reshape(b, -1, hk, g, d).sum(3), dv.reshape(b, -1, hk, g, v.shape[-1]).sum(3)


def training_step(call, inputs, dout):
    """A step for :func:`captured`: the inputs' gradients cleared, ``out = call(*inputs)``,
    ``out.backward(dout)``; returns out."""
    def step():
        for t in inputs:
            t.grad = None
        out = call(*inputs)
        out.backward(dout)
        return out

    return step


def captured(step, warmup: int = 1):
    """``(graph, what step returned while captured)``: ``step`` warmed up on a side stream (as
    torch's CUDA-graph recipe asks), then captured once."""
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


def pytest_collection_finish(session):
    """Start the Triton-interpreter runs of tests/longnet/test_rows.py as soon as the tests are
    collected, where any selected test uses them: minutes of one core each, at the lowest priority
    beside the rest of the suite instead of after it."""
    for item in session.items:
        if "interpreted" in getattr(item, "fixturenames", ()):
            item.module.start_interpreted()
            return


def pytest_sessionfinish(session):
    for item in getattr(session, "items", ()):  # runs left over by a session that ended early
        if "interpreted" in getattr(item, "fixturenames", ()):
            item.module.stop_interpreted()
            return
