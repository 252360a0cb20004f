"""Every committed result row that ran passed its correctness check (a number is only worth what
the result it timed is worth)."""
import glob
import json
import os

ROOT = os.path.join(os.path.dirname(__file__), "..", "results")


def test_every_committed_row_that_ran_passed_its_check():
    paths = sorted(glob.glob(os.path.join(ROOT, "**", "*.jsonl"), recursive=True))
    assert paths, "no committed results found"
    bad = []
    for path in paths:
        with open(path) as f:
            for i, line in enumerate(f, 1):
                row = json.loads(line)
                if row.get("status") != "ok":
                    continue  # oom, unsupported: recorded as such, nothing timed
                check = row.get("check") or {}
                if not check.get("passed") or row.get("check_failed"):
                    bad.append(f"{os.path.relpath(path, ROOT)}:{i} {row.get('implementation')} "
                               f"N={row['config'].get('seq_len')}: {check or 'no check'}")
    assert not bad, "rows that did not pass their check:\n" + "\n".join(bad)
