"""`kernels` mode: runs benchmarks/diagnostics/kernels_bench.py (the paged-attention microbenchmarks) in-process
with the config's ``kernels.args`` as its command line, keeps its stdout as kernels_stdout.txt and copies its
summary table into the report.
"""
from __future__ import annotations

import contextlib
import io
import sys

from .report import Table


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self):
        for st in self.streams:
            st.flush()


def summary_rows(text: str) -> list[list[str]]:
    """The rows of the last `| what | result |` Markdown table kernels_bench prints."""
    lines = text.splitlines()
    starts = [i for i, l in enumerate(lines) if l.replace(" ", "").startswith("|what|result|")]
    if not starts:
        return []
    rows = []
    for line in lines[starts[-1] + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append([cells[0], " | ".join(cells[1:])])
    return rows


def run_kernels(run) -> None:
    from .diagnostics import kernels_bench

    buf = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, buf)):
        rc = kernels_bench.main([str(a) for a in run.cfg["kernels"]["args"]])
    (run.out_dir / "kernels_stdout.txt").write_text(buf.getvalue())
    run.result["exit_code"] = rc
    if rc:
        raise RuntimeError(f"benchmarks/diagnostics/kernels_bench.py exited with {rc}; see {run.out_dir}/kernels_stdout.txt")
    rows = summary_rows(buf.getvalue())
    if rows:
        run.tables.append(Table("kernels_bench summary", ["what", "result"], rows))
        run.result["summary"] = rows
    run.notes.append("kernels_bench.py output: kernels_stdout.txt")
