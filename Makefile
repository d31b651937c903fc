# The two commands a new user needs: `make demo` (the main job on CPU) and `make test`.
# Both create or update .venv from uv.lock first.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-unit test-all lint format bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/rl-tpu demo

# Every test, the real-stack ones included (docs/development.md: about an hour on 2 cores). The `verl` extra is
# installed for tests/integration/test_verl.py (rl-tpu as a verl plugin, docs/verl.md), the `bench` extra (TRL)
# for the check that bench/vs_trl.py's settings are TRL's GRPOConfig fields.
# .venv-xla (torch 2.9 + torch_xla, locks/xla.txt) hosts the xla trainer tests; it takes about 8 GB of disk
# plus uv's download cache. It is always made: without it the xla tests skip, which fails the run under CI=true.
test:
	@bash scripts/setup.sh --extra verl --extra bench
	@bash scripts/setup.sh --role-env xla
	@bash scripts/setup.sh --role-env tpu  # .venv-tpu (Python 3.12, locks/tpu.txt): ~3 min and ~7 GB of uv cache the first time
	@bash scripts/setup.sh --verl-0.7.1  # verl's own interactions and GSM8K tool (tests/integration/test_verl_interactions.py)
	@bash scripts/setup.sh --sandbox  # bubblewrap, for the rollout.sandbox tests (tests/unit/test_containment.py)
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .
	.venv/bin/pytest --durations=30 $(PYTEST_ARGS)

test-all: test

# The quick tier for working on the code: tests/unit, pure logic (docs/development.md: under 2 minutes on
# 2 cores). `make test` runs it too, with everything else.
test-unit:
	@bash scripts/setup.sh --extra verl --extra bench
	.venv/bin/pytest tests/unit $(PYTEST_ARGS)

# ruff (pinned in the `test` extra, configured in pyproject.toml): `make test` checks, `make format` fixes
lint:
	@bash scripts/setup.sh --extra verl --extra bench
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .

format:
	@bash scripts/setup.sh --extra verl --extra bench
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

clean:
	rm -rf .venv runs .pytest_cache
