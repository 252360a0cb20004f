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
        if append:
            _end_with_a_whole_row(path)
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


def _end_with_a_whole_row(path: str) -> None:
    """Before appending to ``path``: a last row written without its newline (by another tool, or an
    editor) gets one, so that the next row is not glued onto it; a last line that is no JSON row
    (a partial write) is refused, naming the file."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
    if tail.endswith(b"\n"):
        return
    last = tail.rsplit(b"\n", 1)[-1]
    try:
        json.loads(last)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path} ends in a partial line (no newline, not a JSON row): repair or move the file "
                         "before --append") from None
    with open(path, "ab") as f:
        f.write(b"\n")


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


_CONFIG_KEYS = {"batch": int, "seq_len": int, "num_heads": int, "head_dim": int, "dtype": str, "causal": bool,
                "mode": str}


def row_problem(row) -> str | None:
    """What keeps ``row`` from being a result row the tools can read, or None: the fields every row
    has (implementation, backend, status, mode, a config of the problem's sizes), and for an ok row
    a time whose median and spread are numbers."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    for key in ("implementation", "backend", "status", "mode"):
        if not isinstance(row.get(key), str):
            return f"no {key!r} string"
    cfg = row.get("config")
    if not isinstance(cfg, dict):
        return "no 'config' object"
    for key, kind in _CONFIG_KEYS.items():
        value = cfg.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"config.{key} is {value!r}, not {'a whole number' if kind is int else kind.__name__}"
    if row["status"] == "ok":
        t = row.get("time_ms")
        if not isinstance(t, dict) or not all(isinstance(t.get(k), (int, float)) and not isinstance(t.get(k), bool)
                                              and t[k] >= 0 for k in ("median", "p10", "p90")):
            return "an ok row without time_ms.median, p10 and p90 (numbers >= 0)"
    return None


def read_results(path: str) -> list[dict]:
    """The rows of a results file, each checked by :func:`row_problem`: a ValueError naming the file,
    the line and what is wrong otherwise."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON row ({e})") from None
            why = row_problem(row)
            if why:
                raise ValueError(f"{path}:{i}: not a result row: {why}")
            rows.append(row)
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


# -- what a row vouches for -----------------------------------------------------------------
def device_kind(row: dict) -> str:
    """The kind of device a row ran on (``cuda``, ``cpu``; empty where the row does not say)."""
    return str(row.get("device", "")).split(":")[0]


def check_passed(row: dict) -> bool | None:
    """Whether ``row``'s result passed its correctness check: ``check.passed`` is the one field that
    decides (None: not checked). Files written before that field was the only one may carry a bare
    ``check_failed``; it is read where ``check`` is absent."""
    chk = row.get("check")
    if isinstance(chk, dict) and "passed" in chk:
        return bool(chk["passed"])
    if "check_failed" in row:
        return not row["check_failed"]
    return None


def first_call_only(row: dict) -> bool:
    """Whether ``row``'s only timed sample is its first call (compiles, plans and start-up
    included): such a time is no steady figure."""
    if "first_call_only" in row:
        return bool(row["first_call_only"])
    return "not warmed up" in str(row.get("time_note") or "")  # rows written before the field


def untrusted_reason(row: dict) -> str | None:
    """Why no derived figure (fit, winner, speed-up, efficiency) may use ``row``, or None."""
    if row.get("status") != "ok":
        return f"status {row.get('status')}"
    if check_passed(row) is False:
        return "check failed"
    if first_call_only(row):
        return "first call only"
    if not isinstance((row.get("time_ms") or {}).get("median"), (int, float)):
        return "no time"
    return None


def trusted(row: dict) -> bool:
    """A row that ran, was timed warm and did not fail its check: derived figures use only these."""
    return untrusted_reason(row) is None
