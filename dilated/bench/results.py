"""Results on disk: one JSON object per row, appended as each row finishes.

Each row is serialised first and written with a single ``write`` of one line followed by flush and
fsync, so a crash or Ctrl-C leaves only whole rows. CSV is derived from the JSONL at the end (by
writing a temporary file and renaming it into place).
"""
from __future__ import annotations

import csv
import json
import os


class ResultWriter:
    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.rows = 0

    def append(self, row: dict) -> None:
        line = json.dumps(row, default=str, allow_nan=True) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.rows += 1


def read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON row ({e})") from None
    return rows


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = " ".join(map(str, v))
        else:
            out[key] = v
    return out


def write_csv(jsonl_path: str, csv_path: str) -> None:
    rows = [_flat(r) for r in read_jsonl(jsonl_path)]
    fields = sorted({k for r in rows for k in r})
    tmp = csv_path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, csv_path)


def write_json(path: str, data) -> None:
    """Write ``data`` as JSON all at once: a temporary file renamed into place."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
