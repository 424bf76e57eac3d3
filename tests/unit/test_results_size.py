"""loadtest/results/ holds only the small files the docs cite: summaries and tables, not plots,
stack logs or raw runs (each bench writes those again with its --out; history keeps the old ones,
see loadtest/results/README.md). Counted are the files a commit would carry: tracked ones and
untracked ones .gitignore lets through, so ignored local runs do not count."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
RESULTS = "loadtest/results"
MAX_TOTAL_BYTES = 2 * 1024 * 1024
MAX_FILE_BYTES = 128 * 1024
RAW_SUFFIXES = {".png", ".log", ".jsonl"}


def committed_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", RESULTS],
                             cwd=ROOT, capture_output=True, check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = (ROOT / name for name in out.decode().split("\0") if name)
    return sorted(p for p in paths if p.is_file())  # a file deleted but not yet staged is on its way out


def test_results_hold_no_plots_or_logs():
    raw = [p.relative_to(ROOT).as_posix() for p in committed_files() if p.suffix in RAW_SUFFIXES]
    assert not raw, f"plots, logs and step traces are regenerated, not committed: {raw}"


def test_each_results_file_is_small():
    big = [f"{p.relative_to(ROOT).as_posix()} ({p.stat().st_size} bytes)" for p in committed_files()
           if p.stat().st_size > MAX_FILE_BYTES]
    assert not big, f"over {MAX_FILE_BYTES} bytes; commit a summary without the per-request arrays: {big}"


def test_results_stay_under_the_total_limit():
    files = committed_files()
    total = sum(p.stat().st_size for p in files)
    assert total <= MAX_TOTAL_BYTES, \
        f"{len(files)} files under {RESULTS} hold {total} bytes, over the limit of {MAX_TOTAL_BYTES}"
