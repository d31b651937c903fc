"""The LoRA adapter an engine serves over its base model (`trainer.lora`): one adapter, one folder.

- The engine starts with vLLM's LoRA on (`lora_kwargs`: one slot, the trainer's rank rounded up to one
  vLLM serves, LoRA layers on the target linears only) and serves the adapter in a folder of its own, in
  /dev/shm, which always holds the version the engine serves: vLLM reloads an adapter lazily from its
  request's path whenever it dropped it (`reset_lora_state`, an LRU eviction).
- Before the first sync the folder holds an adapter that changes nothing (A = 0, B = 0): the trainer's
  first adapters have B = 0, so engine and trainer start from the same policy, the base model; the
  warm-up builds the LoRA kernels with it.
- Every generate path (`LLM.generate`, held partial-rollout requests, the warm-ups) passes `request`,
  which has `load_inplace = False`: vLLM re-applies the active requests on every scheduler step, and one
  with `load_inplace = True` would re-read the folder on every step.
- A new version arrives one of two ways (`sync.transport`): `write(ranks, tensors)` (the default) hands
  the full tensors to every TP rank, which writes them in place into the adapter vLLM registered and into
  its slot through each LoRA layer's `set_lora` (`vllm_compat.lora_write`): no file, no reload; the folder
  is then rewritten on a background thread, so that it again holds the served version. `install(src)`
  (`sync.transport = "reload"`) copies a PEFT folder's files into ours and has every TP rank reload it
  once (`LLMEngine.add_lora` with `load_inplace = True`: vLLM's own load, pack and scale into the same
  slot). Either way the caller then resets the prefix cache, whose block hashes hold the adapter's name
  and path, not its version.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from rl_tpu import peft_folder
from rl_tpu.config import ConfigError, LoraConfig
from rl_tpu.weight_sync.transports import SHM_DIR

log = logging.getLogger("rl_tpu")

NAME, ID = "rl_tpu_policy", 1  # the one adapter an engine serves (vLLM ids start at 1)


class ServedAdapter:
    """The folder an engine serves its adapter from, and the request every generate call carries."""

    files = (peft_folder.CONFIG, peft_folder.WEIGHTS)

    def __init__(self, lc: LoraConfig, hf_shapes: dict[str, tuple[int, ...]], model_path: str, index: int):
        from vllm.lora.request import LoRARequest

        self.lc, self.model_path = lc, model_path
        self.folder = Path(tempfile.mkdtemp(prefix=f"rl_tpu_lora{index}_", dir=SHM_DIR))
        zero = peft_folder.zero_adapter(hf_shapes, lc)
        peft_folder.save(self.folder, zero, lc, model_path)
        self.shapes = {n: tuple(t.shape) for n, t in zero.items()}  # what `write` accepts
        self.request = LoRARequest(NAME, ID, str(self.folder))
        self._saving: threading.Thread | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        from rl_tpu.rollout.engine import lora_kwargs

        return lora_kwargs(self.lc.rank, self.lc.targets)

    def check(self, tensors: dict) -> int:
        """The adapter's bytes if `tensors` are exactly the served adapter's names and shapes; a
        ConfigError naming the first difference otherwise."""
        got = {n: tuple(t.shape) for n, t in tensors.items()}
        if got != self.shapes:
            diff = sorted(set(got) ^ set(self.shapes)) or [n for n in sorted(got) if got[n] != self.shapes[n]]
            n = diff[0]
            raise ConfigError(
                f"adapter tensor {n}: {got.get(n, 'missing')} where the served adapter has "
                f"{self.shapes.get(n, 'none')} ({len(diff)} differ; trainer.lora must match the engine's)"
            )
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def write(self, ranks, tensors: dict, wire) -> int:
        """Serve `tensors` (PEFT names, full; checked by `check`) from now on, written in place by every
        TP rank (`ranks`: the engine's `EngineRanks`; `wire`: the tensors as they can reach them), then
        saved into the folder in the background. Returns the bytes written. The caller resets the prefix
        cache."""
        nbytes = self.check(tensors)
        self._wait_saved()
        ranks.lora_write(wire, ID, self.lc.alpha / self.lc.rank)
        self._saving = threading.Thread(target=self._save, args=(tensors,), daemon=True)
        self._saving.start()
        return nbytes

    def _save(self, tensors: dict) -> None:
        """The folder catches up with what the slots serve (the background thread of `write`)."""
        stage = Path(tempfile.mkdtemp(prefix=".stage_", dir=self.folder.parent))
        try:
            peft_folder.save(stage, tensors, self.lc, self.model_path)
            for f in self.files:  # atomic, as in `_copy_in`
                os.replace(stage / f, self.folder / f)
        except OSError as e:  # the slots serve the new version; only a reload after a drop would not
            log.warning(
                "LoRA adapter folder %s not updated (%s): it holds the previous version", self.folder, e
            )
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def _wait_saved(self) -> None:
        if self._saving is not None:
            self._saving.join()
            self._saving = None

    def install(self, llm, src: str) -> int:
        """Serve the PEFT folder `src` from now on: its files replace the folder's, and every TP rank of
        `llm` reloads the adapter once. Returns the bytes of its weights file. The caller resets the
        prefix cache."""
        from vllm.lora.request import LoRARequest

        peft_folder.read_config(src, max_rank=self.engine_kwargs()["max_lora_rank"])
        self._wait_saved()
        self._copy_in(Path(src))
        reload = LoRARequest(NAME, ID, str(self.folder), load_inplace=True)
        if not llm.llm_engine.add_lora(reload):
            raise RuntimeError(f"vLLM did not load the adapter from {self.folder}")
        return (self.folder / peft_folder.WEIGHTS).stat().st_size

    def _copy_in(self, src: Path) -> None:
        """`src`'s files over ours, each copied beside ours first and moved over it (`os.replace` is atomic:
        a reader sees a whole file, the old one or the new)."""
        stage = Path(tempfile.mkdtemp(prefix=".stage_", dir=self.folder.parent))
        try:
            for f in self.files:
                shutil.copy2(src / f, stage / f)
                os.replace(stage / f, self.folder / f)
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def close(self) -> None:
        self._wait_saved()
        shutil.rmtree(self.folder, ignore_errors=True)
