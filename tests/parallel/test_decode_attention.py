"""decode_attention (dilated.parallel.decode_attention): the local split-key call against float64
softmax, and the sharded cache over real gloo groups (tests/cp_worker.py)."""

import pytest
import torch

import cp_worker
from conftest import free_port, spawn
import dilated
from dilated.parallel.decode_attention import MIN_CHUNK, key_chunks, local_part


def _softmax_attention(q, k, v):
    """float64 ``(out [B, Tq, H, D], lse [B, Tq, H])`` over every key, GQA heads i -> i // (H / Hkv)."""
    g = q.shape[2] // k.shape[2]
    keys, values = (x.double().repeat_interleave(g, 2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bqhk", q.double(), keys) * q.shape[-1] ** -0.5
    return torch.einsum("bqhk,bkhd->bqhd", s.softmax(-1), values), s.logsumexp(-1)


@pytest.mark.parametrize("split", [1, 2, 8])
@pytest.mark.parametrize("tq, h, hkv", [(1, 8, 2), (3, 4, 4), (2, 6, 1)])
def test_local_part_in_key_chunks_is_exact(split, tq, h, hkv):
    g = torch.Generator().manual_seed(split * 100 + h)
    q = torch.randn(2, tq, h, 16, generator=g, dtype=torch.float64) * 2
    k, v = (torch.randn(2, 64, hkv, 16, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = local_part(q, k, v, None, "auto", split)
    ref_out, ref_lse = _softmax_attention(q, k, v)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_key_chunks_fill_the_gpu_with_chunks_of_at_least_min_chunk_rows():
    # batch 1, 8 kv heads: 64 chunks (512 programs) where the rows allow, fewer where they do not
    assert key_chunks(1, 1 << 20, 8) == 64
    assert key_chunks(8, 1 << 20, 8) == 8
    assert key_chunks(1, 4 * MIN_CHUNK, 8) == 4
    assert key_chunks(1, 3 * 1024, 8) == 8  # 8 x 384 rows: 16 chunks would hold fewer than MIN_CHUNK
    assert key_chunks(1, 1030, 8) == 2  # 2 x 515: 4 does not divide 1030
    assert key_chunks(1, MIN_CHUNK + 1, 8) == 1 and key_chunks(64, 1 << 20, 8) == 1


@pytest.mark.parametrize("world, seed", [(2, 0), (3, 1)])
def test_decode_over_a_sharded_cache_is_exact(world, seed):
    spawn(cp_worker.decode, args=(world, free_port(), seed), nprocs=world)


def test_decode_without_a_process_group_is_the_whole_cache_here():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 1, 8, 16, generator=g, dtype=torch.float64) if i == 0 else
               torch.randn(2, 1024, 2, 16, generator=g, dtype=torch.float64) for i in range(3))
    with torch.no_grad():
        out = dilated.decode_attention(q, k, v)  # default split: 1024 rows in chunks of 256
    torch.testing.assert_close(out, _softmax_attention(q, k, v)[0], rtol=1e-12, atol=1e-12)


def test_decode_asks_for_inference_and_matching_shapes():
    q, k = torch.randn(1, 1, 4, 8, requires_grad=True), torch.randn(1, 8, 2, 8)
    with pytest.raises(ValueError, match="no_grad"):
        dilated.decode_attention(q, k, k)
    with torch.no_grad(), pytest.raises(ValueError, match="kv heads"):
        dilated.decode_attention(torch.randn(1, 1, 3, 8), k, k)
    with torch.no_grad(), pytest.raises(ValueError, match="batch and head_dim"):
        dilated.decode_attention(torch.randn(1, 1, 4, 8), k, torch.randn(1, 8, 2, 4))
    with torch.no_grad(), pytest.raises(ValueError, match="split must be a positive int dividing"):
        local_part(torch.randn(1, 1, 4, 8), k, k, None, "auto", 3)
