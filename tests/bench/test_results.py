"""Every committed result row that ran passed its correctness check (a number is only worth what
the result it timed is worth)."""
import glob
import os

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "results")


def _committed():
    paths = sorted(glob.glob(os.path.join(ROOT, "**", "*.jsonl"), recursive=True))
    assert paths, "no committed results found"
    return paths


def test_every_committed_row_that_ran_passed_its_check():
    from dilated.bench.results import check_passed, read_results

    bad = []
    for path in _committed():
        for i, row in enumerate(read_results(path), 1):  # every row is a well-formed result row
            if row.get("status") != "ok":
                continue  # oom, unsupported: recorded as such, nothing timed
            if not check_passed(row):
                bad.append(f"{os.path.relpath(path, ROOT)}:{i} {row.get('implementation')} "
                           f"N={row['config'].get('seq_len')}: {row.get('check') or 'no check'}")
    assert not bad, "rows that did not pass their check:\n" + "\n".join(bad)


def test_results_hold_harness_output_in_dated_folders():
    """``results/<device>/<date>-<purpose>/``: no scripts, nothing loose beside the run folders."""
    import re
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "results"], capture_output=True, text=True,
                             cwd=os.path.join(ROOT, "..")).stdout.split()
    if not tracked:  # not a git checkout (an sdist): nothing to say
        return
    for path in tracked:
        parts = path.split("/")
        assert not path.endswith((".py", ".sh")), f"{path}: results hold harness output, not scripts"
        assert len(parts) == 4 and re.fullmatch(r"\d{4}-\d{2}-\d{2}-[A-Za-z0-9][A-Za-z0-9.-]*", parts[2]), \
            f"{path}: results go under results/<device>/<date>-<purpose>/"
