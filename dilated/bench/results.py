"""Results on disk: one JSON object per row, appended as each row finishes.

Each row is serialised first and written with a single ``write`` of one line followed by flush and
fsync, so a crash or Ctrl-C leaves only whole rows. CSV is derived from the JSONL at the end (by
writing a temporary file and renaming it into place).
"""
from __future__ import annotations

import csv
import datetime
import json
import os


class ResultsWriteError(OSError):
    """A row could not be written whole (disk full, file-size limit): the partial bytes were removed."""


class ResultWriter:
    """Appends rows to ``path``, created now (so that an unwritable place fails before any work).
    ``append=False`` refuses an existing file (:class:`FileExistsError`)."""

    def __init__(self, path: str, append: bool = False):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_EXCL)
        os.close(os.open(path, flags, 0o644))
        self.rows = 0

    @classmethod
    def fresh(cls, directory: str, script: str) -> "ResultWriter":
        """A new file ``<directory>/<script>-<UTC time to the microsecond>.jsonl`` that no other run
        has: created exclusively, with a counter where two runs start in the same microsecond."""
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        for i in range(1000):
            path = os.path.join(directory, f"{script}-{stamp}{f'-{i}' if i else ''}.jsonl")
            try:
                return cls(path)
            except FileExistsError:
                continue
        raise FileExistsError(f"no free results file name under {directory}")

    def append(self, row: dict) -> None:
        """Write ``row`` as one line, whole or not at all: a short or failed write (disk full,
        file-size limit) is truncated back to the last whole row and raises ResultsWriteError."""
        line = (json.dumps(row, default=str, allow_nan=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            size = os.fstat(fd).st_size
            try:
                written = 0
                while written < len(line):
                    n = os.write(fd, line[written:])
                    if n <= 0:
                        raise OSError(f"wrote {written} of {len(line)} bytes")
                    written += n
                os.fsync(fd)
            except OSError as e:
                os.ftruncate(fd, size)
                raise ResultsWriteError(f"{self.path}: a row of {len(line)} bytes could not be written ({e}); "
                                        f"the file holds its {self.rows} whole rows") from None
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
