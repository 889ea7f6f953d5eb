"""`kernels` mode: hands over to benchmarks/kernels_bench.py (the attention microbenchmarks, owned by the
kernels engineer). Its entry point is called in-process, preferring, in order:
  run_from_config(config: dict, out_dir: pathlib.Path) -> dict     (the result, merged into result.json)
  main(argv: list[str]) -> int                                     (argv = the config's kernels.args)
JAXSERVE_BENCH_OUT_DIR names the results folder for files it wants to write; its stdout is kept there as
kernels_stdout.txt.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys

from benchmarks.report import Table


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
    try:
        mod = importlib.import_module("benchmarks.kernels_bench")
    except ModuleNotFoundError as e:
        if e.name != "benchmarks.kernels_bench":
            raise
        raise RuntimeError("mode kernels needs benchmarks/kernels_bench.py (the kernels benchmarks), "
                           "which is not in this checkout") from None
    buf = io.StringIO()
    os.environ["JAXSERVE_BENCH_OUT_DIR"] = str(run.out_dir)
    with contextlib.redirect_stdout(_Tee(sys.stdout, buf)):
        if hasattr(mod, "run_from_config"):
            out = mod.run_from_config(run.cfg, run.out_dir) or {}
            rc = 0
        elif hasattr(mod, "main"):
            rc = mod.main([str(a) for a in run.cfg["kernels"]["args"]])
            out = {}
        else:
            raise RuntimeError("benchmarks/kernels_bench.py has neither run_from_config(config, out_dir) nor main(argv)")
    (run.out_dir / "kernels_stdout.txt").write_text(buf.getvalue())
    run.result["kernels"] = out
    run.result["exit_code"] = rc
    if rc:
        raise RuntimeError(f"benchmarks/kernels_bench.py exited with {rc}; see {run.out_dir}/kernels_stdout.txt")
    for t in out.get("tables", []) if isinstance(out, dict) else []:
        run.tables.append(Table(t.get("title", "kernels"), t["headers"], t["rows"]))
    rows = summary_rows(buf.getvalue())
    if rows:
        run.tables.append(Table("kernels_bench summary", ["what", "result"], rows))
        run.result["summary"] = rows
    run.notes.append("kernels_bench.py output: kernels_stdout.txt (and its own files in this folder)")
