"""Imports point down: cli → server → llm → engine → executor → runner → models → quantization / parallel →
the shared base modules → kernels. Walks every import of jaxserve/, server/ and kernels/ (module level and inside
functions) and fails on an arrow that points up, on kernels/ importing jaxserve, on anything but the CLI's
``bench`` command importing benchmarks/, on ``sys.path`` edits, and on import circles."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the folders that install as packages, and their import names
PACKAGES = {"jaxserve": "jaxserve", "kernels": "jaxserve.kernels", "server": "jaxserve.server"}

# a module's layer: its first name under jaxserve (a subpackage or a top-level module); higher imports lower
RANK = {
    "kernels": 0,
    # the shared base: plain data and settings every layer may read
    "config": 1, "config_decoding": 1, "options": 1, "envs": 1, "errors": 1, "sampling_params": 1, "outputs": 1, "xla_flags": 1,
    "utils": 1, "multimodal": 1,
    "quantization": 2, "parallel": 2,
    "models": 3, "lora": 3,
    "runner": 4,
    "executor": 5,
    "engine": 6,
    "llm": 7, "beam_search": 7,
    "server": 8,
    "cli": 9, "__main__": 9,
}

# arrows that still point up; each entry goes when its module is fixed, and the list ends empty
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_SYS_PATH: set[str] = set()
KNOWN_CIRCLES: set[frozenset[str]] = set()


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for folder, pkg in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = f
    return mods


def _imports(mod: str, path: pathlib.Path, mods: dict) -> set[str]:
    """The project modules ``mod`` imports (``from pkg import name`` counts as pkg.name when that is a module)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("kernels") or name.startswith("server"):
                name = "jaxserve." + name
            if name.split(".")[0] == "benchmarks" or name.startswith("jaxserve.benchmarks"):
                out.add("benchmarks")          # benchmarks/, installed as jaxserve.benchmarks
                continue
            while name and name not in mods and name.split(".")[0] == "jaxserve":
                name = name.rpartition(".")[0]
            if name in mods and name != mod:
                out.add(name)
    return out


def _rank(mod: str) -> int:
    return RANK[mod.split(".")[1]]


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def test_every_module_has_a_layer():
    unknown = sorted(m for m in _modules() if m != "jaxserve" and m.split(".")[1] not in RANK)
    assert not unknown, f"modules outside the layer table (add their layer to RANK): {unknown}"


def test_imports_point_down():
    up = set()
    for mod, targets in _graph().items():
        for t in targets:
            if t.startswith("benchmarks") or t == "jaxserve" or mod == "jaxserve":
                continue            # the package itself: every import runs it first; its facade is lazy
            if _rank(t) > _rank(mod):
                up.add((mod, t))
    assert up - KNOWN_UPWARD == set(), f"imports that point up a layer: {sorted(up - KNOWN_UPWARD)}"
    assert KNOWN_UPWARD - up == set(), f"fixed: remove from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - up)}"


def test_kernels_import_nothing_of_jaxserve():
    bad = sorted((m, t) for m, ts in _graph().items() if m.startswith("jaxserve.kernels")
                 for t in ts if not t.startswith("jaxserve.kernels"))
    assert not bad, f"kernels/ imports jaxserve: {bad}"


def test_only_the_bench_command_imports_benchmarks():
    bad = sorted((m, t) for m, ts in _graph().items() for t in ts
                 if t.startswith("benchmarks") and m != "jaxserve.cli")
    assert not bad, f"only jaxserve.cli's bench command may import benchmarks/: {bad}"


def test_no_sys_path_edits():
    bad = {str(p.relative_to(ROOT)) for p in _modules().values() if "sys.path" in p.read_text()}
    assert bad - KNOWN_SYS_PATH == set(), f"sys.path edits (import the package instead): {sorted(bad)}"
    assert KNOWN_SYS_PATH - bad == set(), f"fixed: remove from KNOWN_SYS_PATH: {sorted(KNOWN_SYS_PATH - bad)}"


def test_no_import_circles():
    """No two modules import each other, directly or through others (a package's ``__init__`` re-exporting
    its own submodules is not a circle)."""
    graph = {m: {t for t in ts if not t.startswith("benchmarks") and not m.startswith(t + ".")}
             for m, ts in _graph().items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):                          # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = set(circles)
    assert found - KNOWN_CIRCLES == set(), f"import circles: {[sorted(c) for c in found - KNOWN_CIRCLES]}"
    assert KNOWN_CIRCLES - found == set(), f"fixed: remove from KNOWN_CIRCLES: {[sorted(c) for c in KNOWN_CIRCLES - found]}"


def test_only_the_app_imports_the_server_routes():
    """server/'s own order: the routes (one module each) on top, wired by the app; what they share (request
    checks, prompts, SamplingParams, engine runs, response rendering, the protocol) sits below and never
    calls back up into a route."""
    routes = {f"jaxserve.server.{name}" for name in ("chat", "completions", "embeddings", "tokenization")}
    bad = sorted((m, t) for m, ts in _graph().items()
                 if m.startswith("jaxserve.server") and m != "jaxserve.server.app" for t in ts if t in routes)
    assert not bad, f"a server module imports a route (only server.app may): {bad}"
