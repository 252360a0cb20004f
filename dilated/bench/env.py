"""The environment a result was measured in, recorded with every row."""
from __future__ import annotations

import datetime
import functools
import importlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys

import torch

from ..backends.graph_shapes import ENV as CUDNN_BUILD_AFTER_ENV
from ..packed import BUCKETS_ENV


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception as e:  # a broken optional extension is recorded, not fatal
        return None if isinstance(e, ImportError) else f"broken: {type(e).__name__}"


def _distribution_version(name: str) -> str | None:
    """An installed distribution's version (for packages without a ``__version__``), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _git_commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


#: environment variables recorded with every row (``None``: not set): how communication shares the GPU,
#: and the project's own that change which kernel calls a row makes
RECORDED_VARIABLES = ("TORCH_NCCL_HIGH_PRIORITY", "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_NVLS_ENABLE",
                      "TORCH_SYMM_MEM_DISABLE_MULTICAST", CUDNN_BUILD_AFTER_ENV, BUCKETS_ENV)


@functools.lru_cache(maxsize=None)
def environment() -> dict:
    env = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": _version("triton"),
        # flash-attn 4 installs a flash_attn namespace of its own: flash-attn 2 by its distribution
        "flash_attn": _distribution_version("flash-attn"),
        "flash_attn_3": _version("flash_attn_interface"),
        "xformers": _version("xformers"),
        "flash_attn_4": _distribution_version("flash-attn-4"),
        "sageattention": _distribution_version("sageattention"),
        "ring_flash_attn": _distribution_version("ring-flash-attn"),
        "yunchang": _distribution_version("yunchang"),
        "git_commit": _git_commit(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpu": None,
        "driver": None,
        "variables": {name: os.environ.get(name) for name in RECORDED_VARIABLES},
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            env["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError, IndexError):
            env["driver"] = None
    return env


_GPU_FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "clocks_event_reasons.active")


def gpu_state(device) -> dict | None:
    """The GPU's SM and memory clocks (MHz), temperature (C), power draw (W) and active clock
    event (throttle) reasons bitmask, read by ``nvidia-smi`` now; None off CUDA or where it cannot
    be read. Recorded around each row's timed calls: a row timed on a slowed GPU says so."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        out = subprocess.run(["nvidia-smi", f"--id=GPU-{uuid}", f"--query-gpu={','.join(_GPU_FIELDS)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")] if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError, IndexError, AttributeError, RuntimeError):
        return None
    if len(values) != len(_GPU_FIELDS):
        return None

    def number(v):
        try:
            return int(v, 16) if v.startswith("0x") else float(v)
        except ValueError:
            return None

    return {"sm_clock_mhz": number(values[0]), "mem_clock_mhz": number(values[1]), "temperature_c": number(values[2]),
            "power_w": number(values[3]), "clock_event_reasons": number(values[4])}


def device_slug() -> str:
    """``h200``, ``h100``... for results/<device>/, ``cpu`` without a GPU."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for known in ("h200", "h100", "b200", "a100", "l40s", "a10g", "l4"):
        if known in name:
            ws = int(os.environ.get("WORLD_SIZE", "1"))
            return f"{known}x{ws}" if ws > 1 else known
    return name.replace("nvidia", "").strip().replace(" ", "-")


def timestamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def command_line() -> str:
    return " ".join([os.path.basename(sys.executable)] + sys.argv)
