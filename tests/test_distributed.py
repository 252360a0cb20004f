"""Ring and distributed dilated attention on real gloo process groups of 2 and 4 ranks."""
import socket
import time

import pytest
import torch.multiprocessing as mp

import dist_worker


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_distributed_dilated_match_single_process(world):
    mp.spawn(dist_worker.correctness, args=(world, _port()), nprocs=world, join=True)


def test_sequence_not_divisible_by_world_size():
    mp.spawn(dist_worker.bad_length, args=(2, _port()), nprocs=2, join=True)


def test_a_rank_that_raises_ends_the_job_naming_it():
    t = time.time()
    with pytest.raises(Exception) as e:
        mp.spawn(dist_worker.dies, args=(2, _port()), nprocs=2, join=True)
    assert "process 1" in str(e.value).lower() and "rank 1 failed on purpose" in str(e.value)
    assert time.time() - t < 60
