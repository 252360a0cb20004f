"""``torch.compile(fullgraph=True)`` of the public attention entry points: no graph break, the
float64 reference's numbers forward and backward, with the eager and (where a C++ compiler is
present) inductor backends; and the custom ops of :mod:`dilated.ops` pass ``torch.library.opcheck``."""
import functools
import gc

import pytest
import torch

import dilated
from dilated.reference import dense_reference, dilated_reference

from conftest import GPU_CASE, TOL, check_gpu_bf16, rand, rel_err

SEGS, DILS = [8, 16], [1, 2]


@functools.cache
def _inductor_reason() -> str | None:
    try:
        torch.compile(lambda x: x.sin() + 1, backend="inductor", fullgraph=True)(torch.randn(4))
        return None
    except Exception as e:  # no C++ toolchain here
        return f"inductor does not compile on this machine: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        torch._dynamo.reset()


@pytest.fixture(params=["eager", "inductor"])
def compiler(request):
    if request.param == "inductor" and _inductor_reason():
        pytest.skip(_inductor_reason())
    torch._dynamo.reset()
    # compiled graphs cached on disk by an earlier run would hide a change in an autograd formula
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield functools.partial(torch.compile, backend=request.param, fullgraph=True)
    torch._dynamo.reset()


def _qkv(gen, n=32, h=4, hkv=2, d=16, dtype=torch.float32):
    return (rand(2, n, h, d, gen=gen, dtype=dtype, requires_grad=True),
            rand(2, n, hkv, d, gen=gen, dtype=dtype, requires_grad=True),
            rand(2, n, hkv, d, gen=gen, dtype=dtype, requires_grad=True))


def _check(out, ref, inputs, ref_inputs, gen, dtype=torch.float32):
    assert rel_err(out, ref) < TOL[dtype]
    dout = rand(*out.shape, gen=gen, dtype=out.dtype)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout.double())
    for i, (g, rg) in enumerate(zip(grads, ref_grads)):
        assert rel_err(g, rg) < 2 * TOL[dtype], f"gradient of input {i}"


def _double(*ts):
    return tuple(t.detach().double().requires_grad_() for t in ts)


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_attention_and_its_lse(compiler, causal, gen):
    q, k, v = _qkv(gen)
    q = q.detach()[:, :24].requires_grad_()  # 24 queries on 32 keys: causal is bottom-right aligned

    @compiler
    def f(q, k, v):
        out, lse = dilated.attention(q, k, v, causal=causal, return_lse=True)
        return out * 1.0, lse  # the lse's gradient flows too

    out, lse = f(q, k, v)
    qd, kd, vd = _double(q, k, v)
    ref, ref_lse = dense_reference(qd, kd, vd, causal=causal)
    assert rel_err(lse, ref_lse) < TOL[torch.float32]
    assert rel_err(out, ref) < TOL[torch.float32]
    dout, dlse = rand(*out.shape, gen=gen), rand(*lse.shape, gen=gen)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    ref_grads = torch.autograd.grad((ref, ref_lse), (qd, kd, vd), (dout.double(), dlse.double()))
    for g, rg in zip(grads, ref_grads):
        assert rel_err(g, rg) < 2 * TOL[torch.float32]


def test_an_unused_lse_costs_no_backward_pass(compiler, gen, monkeypatch):
    """The lse's gradient is one more kernel backward; it runs only where lse gets a gradient. Without
    return_lse, compiled too, where autograd hands the op's unused lse zeros (the op is told that lse
    is dropped: telling zeros from a gradient on the device would make the host wait for the GPU).
    With return_lse, eager knows whether lse got a gradient; compiled, the op counts it as used."""
    from dilated.backends.manual import ManualBackend

    calls = []
    real = ManualBackend.backward
    monkeypatch.setattr(ManualBackend, "backward", lambda self, *a, **kw: (calls.append(1), real(self, *a, **kw))[1])
    q, k, v = _qkv(gen)
    dilated.attention(q, k, v, backend="manual")  # the backend's first use probes its calls

    def out_only(q, k, v):
        return dilated.attention(q, k, v, backend="manual") * 1.0

    def with_lse(q, k, v):
        out, lse = dilated.attention(q, k, v, backend="manual", return_lse=True)
        return out * 1.0, lse

    def backward_calls(fn, lse_grad):
        calls.clear()
        out, lse = fn(q, k, v)
        torch.autograd.grad((out, lse.sum()) if lse_grad else out, (q, k, v),
                            (rand(*out.shape, gen=gen), None) if lse_grad else rand(*out.shape, gen=gen))
        return len(calls)

    assert backward_calls(lambda *t: (out_only(*t), None), False) == 1
    assert backward_calls(lambda *t: (compiler(out_only)(*t), None), False) == 1
    assert backward_calls(with_lse, False) == 1 and backward_calls(with_lse, True) == 2
    assert backward_calls(compiler(with_lse), True) == 2


@pytest.mark.parametrize("module", ["improved", "dilated"])
def test_compiled_dilated_modules(compiler, module, gen):
    if module == "dilated" and compiler.keywords["backend"] == "inductor" and not torch.cuda.is_available():
        # the readable module's many small ops take inductor half a minute of a CPU runner's two
        # cores: there it is traced by the eager backend (the fast module's custom ops still go
        # through inductor); GPU runs compile it with inductor too
        pytest.skip("the readable module under inductor on CPU: traced by the eager backend instead")
    cls = dilated.ImprovedDilatedAttention if module == "improved" else dilated.DilatedAttention
    m = cls(SEGS, DILS, causal=True)
    q, k, v = _qkv(gen, n=30)  # 30: a clipped last segment
    out = compiler(m)(q, k, v)
    ref_in = _double(q, k, v)
    _check(out, dilated_reference(*ref_in, SEGS, DILS, True), (q, k, v), ref_in, gen)


@pytest.mark.parametrize("module", ["attention", "improved"])
def test_compiled_on_a_backend_whose_backward_recomputes_its_forward(compiler, module, gen):
    """sdpa_math (like flex) takes its backward by autograd through its own forward. In a compiled
    graph that backward runs inside a custom op, where torch turns autograd's dispatch off: it must
    still record its graph, or the step fails ("element 0 of tensors does not require grad")."""
    q, k, v = _qkv(gen, n=30)
    if module == "attention":
        out = compiler(lambda q, k, v: dilated.attention(q, k, v, causal=True, backend="sdpa_math"))(q, k, v)
        ref_in = _double(q, k, v)
        ref = dense_reference(*ref_in, causal=True)[0]
    else:
        out = compiler(dilated.ImprovedDilatedAttention(SEGS, DILS, causal=True, backend="sdpa_math"))(q, k, v)
        ref_in = _double(q, k, v)
        ref = dilated_reference(*ref_in, SEGS, DILS, True)
    _check(out, ref, (q, k, v), ref_in, gen)


def test_custom_op_backward_under_inference_mode(gen):
    """The custom backward op called directly, under inference_mode, on a backend whose backward
    goes through autograd: the gradients of the float64 reference."""
    q, k, v = (t.detach().double() for t in _qkv(gen, n=16))
    out, lse = torch.ops.dilated.attention_forward(q, k, v, True, 0.25, "sdpa_math")
    dout = rand(*out.shape, gen=gen, dtype=torch.float64)
    with torch.inference_mode():
        grads = torch.ops.dilated.attention_backward(dout, q, k, v, out, lse, None, True, 0.25, "sdpa_math")
    ref_in = _double(q, k, v)
    ref_grads = torch.autograd.grad(dense_reference(*ref_in, causal=True, scale=0.25)[0], ref_in, dout)
    for g, rg in zip(grads, ref_grads):
        assert rel_err(g, rg) < TOL[torch.float64]


def test_a_module_freed_between_forward_and_backward(compiler, gen):
    """The backward needs no live module: its pattern cache only saves work."""
    q, k, v = _qkv(gen, n=30)
    out = compiler(dilated.ImprovedDilatedAttention(SEGS, DILS, causal=True))(q, k, v)
    gc.collect()
    ref_in = _double(q, k, v)
    _check(out, dilated_reference(*ref_in, SEGS, DILS, True), (q, k, v), ref_in, gen)


def test_compiled_multihead_layer(compiler, gen):
    layer = dilated.MultiheadDilatedAttention(64, 4, SEGS, DILS, num_kv_heads=2, causal=True)
    x = rand(2, 32, 64, gen=gen, requires_grad=True)
    out = compiler(layer)(x)
    ref_layer = dilated.MultiheadDilatedAttention(64, 4, SEGS, DILS, num_kv_heads=2, causal=True,
                                                  dtype=torch.float64)
    ref_layer.load_state_dict(layer.state_dict())
    xd = x.detach().double().requires_grad_()
    q, k, v = ref_layer.project(xd)
    ref = ref_layer.output(dilated_reference(q, k, v, SEGS, DILS, True))
    _check(out, ref, (x,), (xd,), gen)


def test_compiled_inference_uses_the_memory_pool_and_does_not_recompile(compiler, gen):
    pool = dilated.MemoryPool()
    m = compiler(dilated.ImprovedDilatedAttention([8, 16], [2, 4], memory_pool=pool))
    with torch.no_grad():
        for _ in range(2):
            q, k, v = (t.detach() for t in _qkv(gen))
            out = m(q, k, v)
    assert rel_err(out, dilated_reference(*(t.double() for t in (q, k, v)), [8, 16], [2, 4])) < TOL[torch.float32]
    assert pool.stats()["hits"] > 0  # the second call reused the first call's gather buffers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("module", ["improved", "dilated", "multihead"])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_modules_on_the_gpu_in_bf16(compiler, module, causal, gen):
    """The compiled modules on CUDA (Triton gather/combine, fused kernels) in bf16 against float64."""
    def run(q, k, v, segs, dils):
        if module == "multihead":  # identity projections: the layer's attention is the dilated one
            h, d = q.shape[2], q.shape[3]
            layer = dilated.MultiheadDilatedAttention(h * d, h, segs, dils, causal=causal, layer_norm=False,
                                                      device="cuda", dtype=q.dtype)
            with torch.no_grad():
                for proj in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj):
                    proj.weight.copy_(torch.eye(h * d))
                    if proj.bias is not None:
                        proj.bias.zero_()
            out = compiler(layer)(q.flatten(2), k.flatten(2), v.flatten(2))
            return out.view(q.shape)
        cls = dilated.ImprovedDilatedAttention if module == "improved" else dilated.DilatedAttention
        return compiler(cls(segs, dils, causal=causal))(q, k, v)

    check_gpu_bf16(run, causal, gen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("causal,hkv,backend", [(False, 8, "auto"), (True, 8, "auto"), (False, 4, "auto"),
                                                (True, 8, "flex")])
def test_reduce_overhead_replays_training_steps(causal, hkv, backend, gen):
    """``torch.compile(mode="reduce-overhead")`` from cold caches: cudagraph trees run the first
    calls with allocations routed to their graphs' pool and refuse to go on if a tensor made there
    outlives the call (the combine's cached table, a GQA plan's kv-head index: both must be made
    outside it). They record the dilated forward and backward (custom ops, Triton combines, side
    streams) without skipping them, and the replayed steps match float64 in bf16. flex's backward
    recomputes its forward with autograd inside the backward op."""
    from torch._dynamo.utils import counters

    from dilated import branch_combine

    torch._dynamo.reset()
    counters.clear()
    branch_combine._TABLES.clear()  # made again inside the compiled calls
    n, segs, dils = GPU_CASE
    q = rand(1, n, 8, 64, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_()
    k, v = (rand(1, n, hkv, 64, gen=gen, dtype=torch.bfloat16).cuda().requires_grad_() for _ in range(2))
    dout = rand(1, n, 8, 64, gen=gen, dtype=torch.bfloat16).cuda()
    step = torch.compile(dilated.ImprovedDilatedAttention(segs, dils, causal=causal, backend=backend),
                         mode="reduce-overhead")
    for _ in range(4):  # warm-up, recording, replays
        out = step(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        out, grads = out.clone(), [g.clone() for g in grads]  # a replay overwrites its outputs
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] > 0  # graphs were recorded
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dilated_reference(qd, kd, vd, segs, dils, causal)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    for g, rg in zip(grads, torch.autograd.grad(ref, (qd, kd, vd), dout.double())):
        assert rel_err(g, rg) < 2 * TOL[torch.bfloat16]
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_custom_ops_pass_opcheck(dtype, gen):
    q, k, v = _qkv(gen, n=16, dtype=dtype)
    ops = torch.ops.dilated
    for causal in (False, True):
        torch.library.opcheck(ops.attention_forward, (q, k, v, causal, 0.25, "manual"))
        torch.library.opcheck(ops.attention_forward, (q, k, v, causal, 0.25, "manual", False))
        qd, kd, vd = (t.detach() for t in (q, k, v))  # the backward ops have no backward of their own
        out, lse = ops.attention_forward(qd, kd, vd, causal, 0.25, "manual")
        dout, dlse = rand(*out.shape, gen=gen), rand(*lse.shape, gen=gen)
        torch.library.opcheck(ops.attention_backward, (dout, qd, kd, vd, out, lse, dlse, causal, 0.25, "manual"))
        args = ([4, 8], [1, 2], causal, None, "manual", 0, 0, True)
        torch.library.opcheck(ops.dilated_forward, (q, k, v, *args))
        out, lse = ops.dilated_forward(qd, kd, vd, *args)
        torch.library.opcheck(ops.dilated_backward, (dout, qd, kd, vd, out, lse, [4, 8], [1, 2], causal, None,
                                                     "manual", 0))


def test_new_lengths_reuse_one_symbolic_graph(gen):
    """The custom ops take any length: after the first call's graph, one graph with a symbolic
    length serves every other length (torch's automatic dynamic shapes)."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    m = dilated.ImprovedDilatedAttention(SEGS, DILS, causal=True)
    compiled = torch.compile(m, fullgraph=True, backend=counting)
    for n in (32, 48, 40, 72, 100):
        q, k, v = (rand(1, n, 2, 8, gen=gen) for _ in range(3))
        assert rel_err(compiled(q, k, v), dilated_reference(q.double(), k.double(), v.double(), SEGS, DILS, True)) \
            < TOL[torch.float32]
    assert len(graphs) == 2
    torch._dynamo.reset()
