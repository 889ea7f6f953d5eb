"""Results on disk: benchmarks/results/<date>-<name>/ with result.json, result.md, config.yaml and PNGs."""
from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from .config import REPO_ROOT
from .metrics import fmt

# a source checkout keeps results beside the code (benchmarks/results/); an installed jaxserve writes to ./bench-results
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results" if (REPO_ROOT / "pyproject.toml").is_file() else Path("bench-results")


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", "| " + " | ".join(self.headers) + " |",
                 "|" + "|".join("---" for _ in self.headers) + "|"]
        lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in self.rows]
        return "\n".join(lines)


def results_dir(root: Path | None, name: str) -> Path:
    """A fresh folder <root>/<YYYY-MM-DD>-<name>[-N] (a rerun on the same day does not overwrite)."""
    root = Path(root) if root else RESULTS_DIR
    base = f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d}-{name}"
    out, n = root / base, 2
    while out.exists():
        out, n = root / f"{base}-{n}", n + 1
    out.mkdir(parents=True)
    return out


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return None if math.isnan(x) else (str(x) if math.isinf(x) else x)
    return _jsonable(x.tolist()) if isinstance(x, np.ndarray) else x


def write_report(out_dir: Path, cfg: dict, env: dict, result: dict, tables: list[Table], notes: list[str]) -> Path:
    """result.json (everything), result.md (the tables), config.yaml (the exact config run)."""
    (out_dir / "config.yaml").write_text(yaml.safe_dump(_jsonable(cfg), sort_keys=False))
    payload = {"name": cfg["name"], "mode": cfg["mode"], "config": cfg, "environment": env, **result}
    (out_dir / "result.json").write_text(json.dumps(_jsonable(payload), indent=2) + "\n")
    plots = sorted(p.name for p in out_dir.glob("*.png"))
    md = [f"# {cfg['name']} ({cfg['mode']})", "", f"{cfg.get('description') or ''}".strip(), "",
          f"- date: {env.get('date_utc')}  ",
          f"- commit: `{env.get('commit')}`{' (dirty tree)' if env.get('dirty') else ''}  ",
          f"- device: {env.get('device_kind', '?')} × {env.get('device_count', '?')} "
          f"({env.get('platform', '?')}); jax {env.get('jax')}  ",
          f"- command: `{env.get('command')}`", ""]
    for t in tables:
        md += [t.markdown(), ""]
    if notes:
        md += ["### Notes", ""] + [f"- {n}" for n in notes] + [""]
    md += [f"![{p}]({p})" for p in plots]
    (out_dir / "result.md").write_text("\n".join(md).replace("\n\n\n", "\n\n") + "\n")
    return out_dir / "result.md"
