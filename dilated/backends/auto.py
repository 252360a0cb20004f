"""``auto`` by measurement: among the backends that work on a device and accept the inputs, the
fastest on that device and shape class, found by a short timed run and remembered per process
and on disk.

A *shape class* is what decides which kernel wins: the GPU, dtype, head dims, GQA or not, causal,
whether gradients are needed (forward and backward are timed together then), the query and
key lengths rounded up to a power of two and capped at :data:`LONGEST_TIMED` (beyond it the
ranking no longer changes, and timing stays short), and the batch rounded up to a power of two and
capped at :data:`ROWS_TIMED` query rows in all: a call of many short sequences (a dilated branch:
hundreds of segments of 2048 rows) is timed as a device-filling batch, not as one sequence, whose
time is mostly a kernel's host overhead. Each candidate runs :data:`WARMUP` calls
(which absorb a first call's compilation) then :data:`REPS` timed ones (CUDA events on a GPU) on
random inputs of the class's representative shape; the lowest median wins. Kernels that
materialise the score matrix (``manual``, ``sdpa_math``) are not timed where a fused one works:
they never win there, and at a device-filling shape their scores alone take gigabytes (the
first call's peak memory includes the measurement).

The disk cache (``$DILATED_AUTO_CACHE``, default ``~/.cache/dilated/auto.json``; ``0`` turns it
off) is keyed by the GPU, torch, CUDA, cuDNN, triton and the installed kernel libraries' versions,
so a new driver stack measures again. ``DILATED_AUTO=order`` skips measuring: the first backend
of the fixed order that works is taken (the order of :data:`dilated.backends.AUTO_ORDER`).
Measuring is on by default on CUDA; on CPU the fixed order is used (:data:`MEASURED_DEVICES`).
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import statistics
import time

import torch

LONGEST_TIMED = 4096
ROWS_TIMED = 65536  # batch x query rows of a representative call at most: enough to fill a GPU
WARMUP, REPS = 2, 5
#: device types on which ``auto`` measures (elsewhere: the fixed order)
MEASURED_DEVICES = {"cuda"}

_CHOSEN: dict[tuple, str] = {}  # this process: (candidates, shape class) -> backend name


def _bucket(n: int) -> int:
    return 1 if n == 1 else min(LONGEST_TIMED, 1 << max(0, n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def shape_class(q, k, v, causal: bool) -> dict:
    """What decides which kernel is fastest for these inputs."""
    name = _device_name(q.device)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v))
    nq = _bucket(q.shape[1])
    return {"device": name, "dtype": str(q.dtype).removeprefix("torch."), "head_dim": q.shape[3],
            "head_dim_v": (v if v is not None else k).shape[3], "heads": q.shape[2], "kv_heads": k.shape[2],
            "causal": causal, "grad": needs_grad, "nq": nq, "nk": _bucket(k.shape[1]),
            "batch": min(_bucket(q.shape[0]), max(1, ROWS_TIMED // nq))}


@functools.lru_cache(maxsize=None)
def _software() -> str:
    parts = [torch.__version__, str(torch.version.cuda), str(torch.backends.cudnn.version())]
    for dist in ("triton", "flash-attn", "flash-attn-4", "flash_attn_3", "xformers", "sageattention"):
        try:
            parts.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return " ".join(parts)


def _cache_path() -> str | None:
    path = os.environ.get("DILATED_AUTO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dilated",
                                                             "auto.json"))
    return None if path == "0" else path


def _read_disk() -> dict:
    path = _cache_path()
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def _write_disk(key: str, name: str) -> None:
    path = _cache_path()
    if path is None:
        return
    data = _read_disk()
    data[key] = name
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(tmp, path)  # whole or not at all, also with several processes writing
    except OSError:
        pass  # an unwritable cache costs a measurement next time, nothing else


def _time_ms(backend, shape: dict, device) -> float:
    """Median time of ``backend`` on random inputs of the class's representative shape."""
    dtype = getattr(torch, shape["dtype"])
    gen = torch.Generator(device=device).manual_seed(0)

    def r(n, h, d):
        return torch.randn(shape["batch"], n, h, d, generator=gen, device=device, dtype=dtype)

    q, k, v = r(shape["nq"], shape["heads"], shape["head_dim"]), r(shape["nk"], shape["kv_heads"], shape["head_dim"]), \
        r(shape["nk"], shape["kv_heads"], shape["head_dim_v"])
    scale = shape["head_dim"] ** -0.5
    causal = shape["causal"] and shape["nq"] == shape["nk"]  # backends take square-causal pieces only
    if backend.native_gqa is False and shape["kv_heads"] != shape["heads"]:
        g = shape["heads"] // shape["kv_heads"]
        k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    dout = r(shape["nq"], shape["heads"], shape["head_dim_v"]) if shape["grad"] else None

    def call():
        out, lse = backend.forward(q, k, v, causal, scale)
        if dout is not None:
            backend.backward(dout, q, k, v, out, lse, causal, scale)

    with torch.no_grad():
        for _ in range(WARMUP):
            call()
        times = []
        for _ in range(REPS):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fastest(candidates: list, q, k, v, causal: bool):
    """The fastest of ``candidates`` (backends that work here and accept the inputs, in the fixed
    order) for the inputs' shape class; the first of them where measuring is off or fails."""
    device = q.device
    if len(candidates) == 1 or device.type not in MEASURED_DEVICES or os.environ.get("DILATED_AUTO") == "order":
        return candidates[0]
    fused = [c for c in candidates if not c.materializes_scores]
    if fused and len(fused) < len(candidates):  # never the fastest, and their scores take gigabytes
        candidates = fused
        if len(candidates) == 1:
            return candidates[0]
    shape = shape_class(q, k, v, causal)
    names = tuple(c.name for c in candidates)
    key = (names, tuple(shape.values()))
    by_name = {c.name: c for c in candidates}
    name = _CHOSEN.get(key)
    if name is not None:
        return by_name[name]
    disk_key = json.dumps([_software(), names, shape], sort_keys=True)
    name = _read_disk().get(disk_key)
    if name not in by_name:
        times = {}
        for c in candidates:
            try:
                times[c.name] = _time_ms(c, shape, device)
            except Exception:  # a kernel that fails on the representative shape is not chosen
                continue
        name = min(times, key=times.get) if times else candidates[0].name
        _write_disk(disk_key, name)
    _CHOSEN[key] = name
    return by_name[name]


def clear() -> None:
    """Forget this process's choices (the disk cache stays)."""
    _CHOSEN.clear()
