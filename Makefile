# The two commands a new user needs: `make demo` (the main job on CPU) and `make test`.
# Both create or update .venv from uv.lock first.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-all bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/rl-tpu demo

# Every test, the real-stack ones included: about 36 minutes on 2 cores (2026-11-30). The `verl` extra is
# installed for tests/test_verl.py (rl-tpu as a verl plugin, docs/verl.md).
test:
	@bash scripts/setup.sh --extra verl
	.venv/bin/pytest $(PYTEST_ARGS)

test-all: test

clean:
	rm -rf .venv runs .pytest_cache
