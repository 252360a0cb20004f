"""Context-parallel strategies beside the ring: Ulysses and the Ulysses x ring hybrid, on real gloo
process groups, exact against a float64 reference forward and backward."""
import socket

import pytest
import torch.multiprocessing as mp

import cp_worker


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_is_exact_forward_and_backward(world):
    mp.spawn(cp_worker.ulysses, args=(world, _port()), nprocs=world, join=True)


@pytest.mark.parametrize("world, grids", [(4, [(2, 2), (4, 1), (1, 4)]), (6, [(2, 3), (3, 2)])])
def test_hybrid_grids_are_exact_forward_and_backward(world, grids):
    mp.spawn(cp_worker.hybrid, args=(world, _port(), grids), nprocs=world, join=True)


def test_every_sequence_parallel_module_shards_and_unshards_in_its_layout():
    mp.spawn(cp_worker.shard_methods, args=(2, _port()), nprocs=2, join=True)


def test_ulysses_keeps_attention_within_packed_documents():
    mp.spawn(cp_worker.ulysses_documents, args=(2, _port()), nprocs=2, join=True)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_hybrid_keep_attention_within_packed_documents(world):
    mp.spawn(cp_worker.ring_documents, args=(world, _port()), nprocs=world, join=True)
