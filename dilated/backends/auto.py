"""``auto`` by measurement: among the backends that work on a device and accept the inputs, the
fastest on that device and shape class, found by a short timed run and remembered per process
and on disk.

A *shape class* is what decides which kernel wins: the GPU, dtype, head dims, GQA or not, causal,
whether gradients are needed (forward and backward are timed together then), the query and
key lengths rounded up to a power of two and capped at :data:`LONGEST_TIMED` (beyond it the
ranking no longer changes, and timing stays short), and one of two batch states: one sequence of
at most that length, timed as it is (its time is mostly a kernel's host overhead), or anything
larger, timed as a device-filling batch of :data:`ROWS_TIMED` rows (a dilated branch, hundreds of
segments of 2048 rows, or one long sequence). The two states of a class are measured together,
so a dilated step whose segment count changes with the length never measures at a later length.
Each candidate runs :data:`WARMUP` calls (which absorb a first call's compilation) then
:data:`REPS` timed ones (CUDA events on a GPU) on random inputs of the class's representative
shape; the lowest median wins. A candidate that would run the same kernel as one before it
(``sdpa`` where PyTorch chooses cuDNN) is not timed twice. Kernels that materialise the score
matrix (``manual``, ``sdpa_math``) are not timed where a fused one works: they never win there,
and at a device-filling shape their scores alone take gigabytes (the first call's peak memory
includes the measurement). Nor is one that compiles per shape (``flex``, a few seconds per class)
where one that does not works.

The disk cache (``$DILATED_AUTO_CACHE``, default ``~/.cache/dilated/auto.json``; ``0`` turns it
off) is keyed by the GPU, torch, CUDA, cuDNN, triton and the installed kernel libraries' versions,
so a new driver stack measures again. A measurement in which a candidate ran out of memory is
kept for the process only, and the measurement's memory goes back to the device after it.
``DILATED_AUTO=order`` skips measuring: the first backend of the fixed order that works is taken
(the order of :data:`dilated.backends.AUTO_ORDER`). Measuring is on by default on CUDA; on CPU the
fixed order is used (:data:`MEASURED_DEVICES`).
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
    nq, nk = _bucket(q.shape[1]), _bucket(k.shape[1])
    one = q.shape[0] == 1 and q.shape[1] <= LONGEST_TIMED  # one sequence short enough to be timed as it is
    return {"device": name, "dtype": str(q.dtype).removeprefix("torch."), "head_dim": q.shape[3],
            "head_dim_v": (v if v is not None else k).shape[3], "heads": q.shape[2], "kv_heads": k.shape[2],
            "causal": causal, "grad": needs_grad, "nq": nq, "nk": nk, "batch": 1 if one else _filling_batch(nq, nk)}


def _filling_batch(nq: int, nk: int) -> int:
    """The batch of a device-filling representative call: :data:`ROWS_TIMED` rows of the longer side."""
    return max(1, ROWS_TIMED // max(nq, nk))


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


def _inputs(shape: dict, device):
    """Random q, k, v and dout (None without gradients) of the class's representative shape."""
    dtype = getattr(torch, shape["dtype"])
    gen = torch.Generator(device=device).manual_seed(0)

    def r(n, h, d):
        return torch.randn(shape["batch"], n, h, d, generator=gen, device=device, dtype=dtype)

    q, k, v = r(shape["nq"], shape["heads"], shape["head_dim"]), r(shape["nk"], shape["kv_heads"], shape["head_dim"]), \
        r(shape["nk"], shape["kv_heads"], shape["head_dim_v"])
    return q, k, v, (r(shape["nq"], shape["heads"], shape["head_dim_v"]) if shape["grad"] else None)


def _time_ms(backend, q, k, v, dout, causal: bool) -> float:
    """Median time of ``backend`` on these inputs (k and v expanded to q's heads already where it
    has no native GQA)."""
    scale = q.shape[-1] ** -0.5

    def call():
        out, lse = backend.forward(q, k, v, causal, scale)
        if dout is not None:
            backend.backward(dout, q, k, v, out, lse, causal, scale)

    with torch.no_grad():
        for _ in range(WARMUP):
            call()
        times = []
        for _ in range(REPS):
            if q.device.type == "cuda":
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


def _measure(candidates: list, shape: dict, device) -> tuple[str, bool]:
    """``(name, lasting)``: the fastest of ``candidates`` on the class's representative shape, and
    whether the answer may be kept on disk (not where a candidate ran out of memory: with more
    memory free, another time, it might have won). A candidate that would run the same kernel as
    one before it (``sdpa`` where PyTorch chooses cuDNN, beside ``sdpa_cudnn``) is not timed again;
    one that fails there is not chosen."""
    times, kernels, lasting = {}, set(), True
    try:
        q, k, v, dout = _inputs(shape, device)
    except torch.OutOfMemoryError:
        return candidates[0].name, False
    causal = shape["causal"] and shape["nq"] == shape["nk"]  # backends take square-causal pieces only
    for c in candidates:
        kc, vc = k, v
        try:
            if shape["kv_heads"] != shape["heads"] and not c.takes_kv_heads(q, k, causal):
                g = shape["heads"] // shape["kv_heads"]
                kc, vc = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
            kernel = c.kernel_name(q, kc, causal)
            if kernel in kernels:
                continue
            times[c.name] = _time_ms(c, q, kc, vc, dout, causal)
            kernels.add(kernel)
        except torch.OutOfMemoryError:
            lasting = False
        except Exception:  # a kernel that fails on the representative shape is not chosen
            continue
    del q, k, v, dout, kc, vc
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        torch.cuda.empty_cache()  # the measurement's inputs and workspaces go back to the device
    return (min(times, key=times.get) if times else candidates[0].name), lasting


def _sibling(shape: dict) -> dict:
    """The same class for the other batch state: one sequence <-> a device-filling batch."""
    return {**shape, "batch": _filling_batch(shape["nq"], shape["nk"]) if shape["batch"] == 1 else 1}


def fastest(candidates: list, q, k, v, causal: bool):
    """The fastest of ``candidates`` (backends that work here and accept the inputs, in the fixed
    order) for the inputs' shape class; the first of them where measuring is off or fails.

    A class not yet known is measured together with its sibling of the other batch state, so that a
    later call whose batch (a dilated step's segment count at another length) crosses between them
    measures nothing."""
    device = q.device
    if len(candidates) == 1 or device.type not in MEASURED_DEVICES or os.environ.get("DILATED_AUTO") == "order":
        return candidates[0]
    # kernels that materialise the scores never win where a fused one works, and at a device-filling
    # shape their scores alone take gigabytes; one that compiles per shape would cost seconds per class
    fused = [c for c in candidates if not c.materializes_scores] or candidates
    candidates = [c for c in fused if not c.compiles_per_shape] or fused
    if len(candidates) == 1:
        return candidates[0]
    shape = shape_class(q, k, v, causal)
    names = tuple(c.name for c in candidates)
    by_name = {c.name: c for c in candidates}
    name = _CHOSEN.get((names, tuple(shape.values())))
    if name is not None:  # known in this process, and so is its sibling
        return by_name[name]
    chosen = None
    for cls in (shape, _sibling(shape)):
        key = (names, tuple(cls.values()))
        name = _CHOSEN.get(key)
        if name is None:
            disk_key = json.dumps([_software(), names, cls], sort_keys=True)
            name = _read_disk().get(disk_key)
            if name not in by_name:
                name, lasting = _measure(candidates, cls, device)
                if lasting:
                    _write_disk(disk_key, name)
            _CHOSEN[key] = name
        chosen = chosen or name
    return by_name[chosen]


def clear() -> None:
    """Forget this process's choices (the disk cache stays)."""
    _CHOSEN.clear()
