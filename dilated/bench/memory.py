"""Peak memory of one call: CUDA allocator statistics, or peak RSS on Linux CPUs."""
from __future__ import annotations


import torch

from ..parallel.peer_copy import held_bytes

MiB = 1 << 20


def _rss_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


_MALLOC_PINNED = False


def large_allocations_tracked() -> bool:
    return _MALLOC_PINNED


def track_large_allocations() -> None:
    """Make glibc serve every allocation above 64 KiB with its own mmap, returned on free: a setting
    of the whole process, for the benchmark programs (their entry points call it), not done by
    merely using the library.

    By default glibc raises that threshold as large blocks are freed (up to 32 MiB) and then reuses
    freed heap memory, so a call's tensors would not show in the resident set and peak RSS would
    miss them. Pinning the threshold makes peak RSS follow the tensors a call allocates.
    """
    global _MALLOC_PINNED
    if _MALLOC_PINNED:
        return
    _MALLOC_PINNED = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _reset_cpu_peak() -> bool:
    try:  # Linux >= 4.0: "5" resets the peak resident set size (VmHWM) to the current one
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_above_mib`` (above what was held before)
    and ``m.peak_total_mib``. On CPU these are resident-set figures of the whole process. On CUDA,
    torch's allocator peak plus the symmetric buffers held at the end (copy-engine transfers publish
    from them; the allocator's statistics leave them out): the total counts them all, the part
    above what was held before those made during the call."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.peak_above_mib = None
        self.peak_total_mib = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self._symmetric = held_bytes(self.device)
        else:
            self._ok = _reset_cpu_peak()
            self._base = _rss_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak, symmetric = torch.cuda.max_memory_allocated(self.device), held_bytes(self.device)
            self.peak_total_mib = (peak + symmetric) / MiB
            self.peak_above_mib = (peak - self._base + symmetric - self._symmetric) / MiB
        elif self._ok and self._base is not None:
            peak = _rss_bytes("VmHWM")
            self.peak_total_mib = peak / MiB
            self.peak_above_mib = max(0, peak - self._base) / MiB
        return False


def free_memory(device) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.cuda.OutOfMemoryError) or isinstance(e, MemoryError):
        return True
    text = str(e).lower()
    # CPU allocations: "DefaultCPUAllocator: can't allocate memory" / "not enough memory"
    return isinstance(e, RuntimeError) and any(s in text for s in ("out of memory", "can't allocate memory",
                                                                    "not enough memory"))


