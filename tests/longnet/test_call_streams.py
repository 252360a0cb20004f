"""The calls of a step taken in turns by CUDA streams: ordering (fork and join) and the setting."""
import pytest
import torch

from dilated import ImprovedDilatedAttention
from dilated.longnet.call_streams import ENV, call_streams, streams_from_env

from conftest import captured, training_step

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SLEEP = 50_000_000  # cycles of torch.cuda._sleep: tens of milliseconds, far longer than the launches


def test_setting(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert streams_from_env() == 2
    monkeypatch.setenv(ENV, "1")
    assert streams_from_env() == 1
    for bad in ("0", "two", "-3"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            streams_from_env()


def test_off_cuda_every_turn_is_the_current_stream():
    with call_streams(torch.device("cpu"), 5) as turn:
        for i in range(5):
            with turn(i):
                pass


@cuda
def test_side_stream_starts_after_what_came_before_and_is_joined(monkeypatch):
    monkeypatch.setenv(ENV, "2")
    dev = torch.device("cuda")
    src = torch.zeros(1 << 20, device=dev)
    torch.cuda._sleep(SLEEP)
    src.fill_(1.0)  # queued on the current stream behind the sleep
    with call_streams(dev, 2) as turn:
        with turn(1):
            assert torch.cuda.current_stream() != torch.cuda.default_stream()
            copied = src.clone()  # without the fork this reads zeros
            torch.cuda._sleep(SLEEP)
            done = torch.ones(1, device=dev)
    seen = done.clone()  # without the join this may run before the side stream's write
    torch.cuda.synchronize()
    assert copied.min().item() == 1.0
    assert seen.item() == 1.0


@cuda
@pytest.mark.parametrize("backend", ["auto", "sdpa_flash"])
def test_forward_the_same_on_one_stream_and_two(monkeypatch, backend):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8192, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    m = ImprovedDilatedAttention([1024, 2048, 4096], [1, 2, 4], backend=backend)
    outs = []
    for n in ("1", "2"):
        monkeypatch.setenv(ENV, n)
        with torch.no_grad():
            outs.append(m(q, k, v))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@cuda
@pytest.mark.parametrize("backend", ["auto", "sdpa_flash"])
def test_backward_the_same_on_one_stream_and_two(monkeypatch, backend):
    """The backward's calls taken in turns compute the gradients one stream computes (the flash
    backward adds dq in any order: bf16 rounding apart)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8192, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    m = ImprovedDilatedAttention([1024, 2048, 4096], [1, 2, 4], backend=backend)
    grads = []
    for n in ("1", "2"):
        monkeypatch.setenv(ENV, n)
        for x in (q, k, v):
            x.grad = None
        m(q, k, v).backward(dout)
        grads.append([x.grad.float() for x in (q, k, v)])
    for one, two in zip(*grads):
        assert (one - two).abs().max() <= 1e-2 * one.abs().max()


@cuda
def test_forward_captured_in_a_cuda_graph(monkeypatch):
    """The fork and join are recorded into a graph: its replays compute what eager calls do."""
    monkeypatch.setenv(ENV, "2")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8192, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    m = ImprovedDilatedAttention([1024, 2048, 4096], [1, 2, 4], backend="sdpa_flash")
    with torch.no_grad():
        graph, out = captured(lambda: m(q, k, v))
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))  # new inputs where the graph reads them
        graph.replay()
        expected = m(q, k, v)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@cuda
def test_forward_and_backward_captured_in_a_cuda_graph():
    """A whole training step (forward, backward, the combines' tables) captured once: its replays
    on new inputs compute what eager calls do, after the cached launch recipes have been dropped
    and free memory handed out again."""
    from dilated import branch_combine

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8192, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 8192, 8, 64, device="cuda", dtype=torch.bfloat16)
    m = ImprovedDilatedAttention([1024, 2048, 4096], [1, 2, 4], backend="sdpa_flash")

    step = training_step(m, (q, k, v), dout)
    graph, out = captured(step)
    grads = [x.grad for x in (q, k, v)]
    branch_combine._TABLES.clear()
    torch.cuda.empty_cache()
    filler = [torch.full((n,), -1, dtype=torch.int64, device="cuda")  # the freed memory, reused (both pools)
              for n in [1 << 20] * 8 + [64] * 4096]
    with torch.no_grad():
        for x in (q, dout):
            x.copy_(torch.randn_like(x))  # new inputs where the graph reads them
    graph.replay()
    del filler
    expected = step()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for g, x in zip(grads, (q, k, v)):  # the flash backward's dq adds in any order: bf16 rounding apart
        assert (g.float() - x.grad.float()).abs().max() <= 1e-2 * x.grad.float().abs().max()
