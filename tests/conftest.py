import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
