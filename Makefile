# jaxserve — `make serve` sets itself up and serves the default model; `make test` runs the tests.
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup serve generate test test-slow test-all bench-smoke oracle-env fixtures clean

setup:
	@bash tools/setup.sh

serve: setup
	$(PY) -m jaxserve serve $(ARGS)

generate: setup
	$(PY) -m jaxserve generate --chat --prompt "What is the capital of France?" $(ARGS)

# pytest-xdist workers, each running whole files (a file's module-scoped engines stay in one process): the
# suite compiles and runs on one core at a time for long stretches, so two workers keep two cores busy. A
# crashed worker is not replaced: under --dist loadfile xdist can hang after replacing one (pytest-xdist
# #784), so the run ends at once instead, naming the test it crashed in
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0

test: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow and not gpu" --durations=25 $(ARGS)

test-slow: setup
	$(PY) -m pytest -q -m "slow" $(ARGS)

test-all: setup
	$(PY) -m pytest -q $(XDIST) -m "not gpu" $(ARGS)

bench-smoke: setup
	$(PY) -m jaxserve bench --config configs/bench/cpu-smoke.yaml

# The HF transformers oracle env (Python 3.11 + torch CPU) used to regenerate golden fixtures.
oracle-env:
	@bash tools/oracle_env.sh

fixtures: oracle-env
	.venv-oracle/bin/python tests/make_model_fixtures.py
	.venv-oracle/bin/python tests/make_embedding_fixtures.py

clean:
	rm -rf .venv .venv-oracle .jax_cache .pytest_cache
