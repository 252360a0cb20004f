"""What the GPU did in a profiled call: a summary of the Chrome/Perfetto traces that the benchmarks'
``--profile DIR`` writes (one per row and rank), to tell waiting from working.

For each trace: every CUDA stream's busy time, its NCCL kernels (start, duration), its idle time
and how much of it came before the host had launched the next kernel (the GPU waiting for the
host rather than for another stream), its longest idle gaps (what ran before and after), the
host's longest synchronisations; then the GPU time per kernel (attention kernels of cuDNN,
flash-attn 4 and torch's flash summed under one name each) side by side for the traces given,
such as the ranks of one row.

    python benchmarks/specialized/trace_summary.py TRACE.json[.gz] [TRACE.json[.gz] ...]
"""
import argparse
import collections
import gzip
import json
import os


def _events(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _gpu(events) -> list:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def _kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if "flash_attncute" in low:  # flash-attn 4's CuTe-DSL kernels (their names also hold sm90)
        return "attention (flash-attn 4)"
    if "cudnn" in low or "sm90" in low or "fmha" in low:
        return "attention (cuDNN)"
    if "flash" in low:
        return "attention (flash)"
    return name[:64]


def _launched_late(before: dict, after: dict, launches: dict) -> float:
    """Of the idle time between two events of a stream, the part before the host had launched the
    second (its runtime call, by correlation id, ended after the first event ended): time the GPU
    waited for the host, not for another stream. 0 where the launch is not in the trace."""
    launch = launches.get(after.get("args", {}).get("correlation"))
    if launch is None:
        return 0.0
    end = before["ts"] + before["dur"]
    return max(0.0, min(after["ts"] - end, launch["ts"] + launch["dur"] - end))


def timeline(path: str, gaps: int = 8) -> str:
    """Streams, NCCL kernels, idle gaps and host synchronisations of one trace."""
    events = _events(path)
    gpu = _gpu(events)
    if not gpu:
        return f"== {os.path.basename(path)}: no GPU events"
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    lines = [f"== {os.path.basename(path)}: {(t1 - t0) / 1e3:.1f} ms from the first kernel to the last, "
             f"{len(gpu)} GPU events"]
    launches = {e["args"]["correlation"]: e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
                and "correlation" in e.get("args", {})}
    streams = collections.defaultdict(list)
    for e in gpu:
        streams[e.get("args", {}).get("stream", e.get("tid"))].append(e)
    for stream, es in sorted(streams.items(), key=lambda x: -sum(e["dur"] for e in x[1])):
        es.sort(key=lambda e: e["ts"])
        nccl = [e for e in es if _kind(e["name"]) == "nccl"]
        lines.append(f" stream {stream}: {len(es)} events, busy {sum(e['dur'] for e in es) / 1e3:.1f} ms, "
                     f"NCCL {len(nccl)} ({sum(e['dur'] for e in nccl) / 1e3:.1f} ms)")
        lines += [f"   NCCL at {(e['ts'] - t0) / 1e3:.1f} ms for {e['dur'] / 1e3:.2f} ms: {e['name'][:60]}" for e in nccl]
        idle = sorted(((b["ts"] - a["ts"] - a["dur"], a, b) for a, b in zip(es, es[1:])), key=lambda x: -x[0])
        late = {id(b): _launched_late(a, b, launches) for _, a, b in idle}
        lines.append(f"   idle {sum(g for g, _, _ in idle) / 1e3:.2f} ms: "
                     f"{sum(late.values()) / 1e3:.2f} ms of it before the host had launched the next kernel")
        lines += [f"   idle {g / 1e3:.2f} ms at {(a['ts'] + a['dur'] - t0) / 1e3:.1f} ms: after {a['name'][:48]} | "
                  f"before {b['name'][:48]}" + (f" (launched {late[id(b)] / 1e3:.2f} ms late)" if late[id(b)] else "")
                  for g, a, b in idle[:gaps] if g > 500]
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
            and "synchron" in e["name"].lower()]
    lines += [f" host {e['name']} {e['dur'] / 1e3:.2f} ms" for e in sorted(host, key=lambda e: -e["dur"])[:4]]
    return "\n".join(lines)


def kernels_side_by_side(paths: list[str], top: int = 25) -> str:
    """GPU ms and count per kernel, one column per trace."""
    per = []
    for path in paths:
        ms, count = collections.Counter(), collections.Counter()
        for e in _gpu(_events(path)):
            ms[_kind(e["name"])] += e["dur"] / 1e3
            count[_kind(e["name"])] += 1
        per.append((ms, count))
    names = sorted({k for ms, _ in per for k in ms}, key=lambda k: -sum(ms[k] for ms, _ in per))
    head = f"{'kernel':<66}" + "".join(f"{'trace ' + str(i + 1):>22}" for i in range(len(paths)))
    rows = [head] + [f"{k:<66}" + "".join(f"{ms[k]:>12.2f} ms ({count[k]:>4})" for ms, count in per)
                     for k in names[:top]]
    rows += [f"trace {i + 1}: {os.path.basename(p)}" for i, p in enumerate(paths)]
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="traces written by --profile (.json, or .json.gz)")
    args = p.parse_args()
    for path in args.traces:
        print(timeline(path))
    print()
    print(kernels_side_by_side(args.traces))


if __name__ == "__main__":
    main()
