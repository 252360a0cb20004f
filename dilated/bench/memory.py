"""Peak memory of one call: CUDA allocator statistics, or peak RSS on Linux CPUs."""
from __future__ import annotations


import torch

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


def _reset_cpu_peak() -> bool:
    try:  # Linux >= 4.0: "5" resets the peak resident set size (VmHWM) to the current one
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_above_mib`` (above what was held before)
    and ``m.peak_total_mib``. On CPU these are resident-set figures of the whole process."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.peak_above_mib = None
        self.peak_total_mib = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._ok = _reset_cpu_peak()
            self._base = _rss_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.peak_total_mib = peak / MiB
            self.peak_above_mib = (peak - self._base) / MiB
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
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


