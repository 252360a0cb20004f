import torch.distributed as dist


class ProcessGroupSingleton:
    ULYSSES_PG = None
    RING_PG = None


PROCESS_GROUP = ProcessGroupSingleton()
HAS_FLASH_ATTN = True  # tests set it False to take the torch-attention path
DEGREES = []  # (ulysses, ring) of each set_seq_parallel_pg call


def set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size, use_ulysses_low=True):
    assert sp_ulysses_degree * sp_ring_degree == world_size == dist.get_world_size() and rank == dist.get_rank()
    DEGREES.append((sp_ulysses_degree, sp_ring_degree))
    PROCESS_GROUP.ULYSSES_PG = PROCESS_GROUP.RING_PG = dist.group.WORLD
