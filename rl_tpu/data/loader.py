"""Prompt batches for the RL loop: a resumable endless loader, chat-template encoding, data sets by config.

Invariants:
- `PromptLoader` yields batches of exactly `batch_size` examples forever. The stream is the
  concatenation of epochs; epoch e is a permutation drawn from `random.Random(f"{seed}:{e}")` (identity
  when `shuffle` is off), so the order depends only on (seed, epoch, number of examples). A batch may
  straddle two epochs (the tail of one and the head of the next): no example is dropped or repeated
  within an epoch.
- `state_dict()` is (epoch, position, seed, shuffle, num_examples); `load_state_dict` restores the first
  four (the saved seed wins, so a resumed run continues the same order even if the config's seed
  changed) and refuses a data set of another size.
- `encode_prompts` renders each example's messages with the tokenizer's chat template and
  `add_generation_prompt=True`, then tokenizes without adding special tokens (what
  `apply_chat_template(tokenize=True)` does). An over-long prompt raises `DataError` naming the uid
  (verl's `truncation="error"`); `truncation="left"` keeps the last `max_prompt_length` tokens instead.
  `check_prompt_lengths` runs that check over a whole data set before a run starts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

from rl_tpu.config import DataConfig
from rl_tpu.data.files import load_examples
from rl_tpu.data.schema import DataError, Example
from rl_tpu.data.synthetic import make_synthetic


class PromptLoader(Iterator[list[Example]]):
    def __init__(self, examples: Sequence[Example], batch_size: int, shuffle: bool = True, seed: int = 0):
        if not examples:
            raise DataError("PromptLoader needs at least one example (the data set is empty)")
        if batch_size < 1:
            raise DataError(f"PromptLoader batch_size must be >= 1, got {batch_size}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # index into the current epoch's order of the next example to yield
        self._order: list[int] | None = None

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> PromptLoader:
        return self

    def __next__(self) -> list[Example]:
        batch: list[Example] = []
        while len(batch) < self.batch_size:
            if self._order is None:
                self._order = self.epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), len(self._order) - self.position)
            batch += [self.examples[i] for i in self._order[self.position : self.position + take]]
            self.position += take
            if self.position == len(self._order):
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"epoch", "position", "seed", "num_examples"} - set(state)
        if missing:
            raise DataError(f"PromptLoader state is missing {sorted(missing)}")
        if state["num_examples"] != len(self.examples):
            raise DataError(
                f"PromptLoader state was saved for {state['num_examples']} examples but the data "
                f"set now has {len(self.examples)}; the data order cannot be resumed"
            )
        if not 0 <= state["position"] < len(self.examples):
            raise DataError(
                f"PromptLoader state position {state['position']} is outside 0..{len(self.examples) - 1}"
            )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self.shuffle = state.get("shuffle", self.shuffle)
        self._order = None


def encode_prompts(
    tokenizer: Any, examples: Sequence[Example], max_prompt_length: int, truncation: str = "error"
) -> list[list[int]]:
    """Token ids of each example's chat-templated prompt (see module docstring)."""
    if truncation not in ("error", "left"):
        raise DataError(f"truncation must be 'error' or 'left', got {truncation!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
            "prompts are chat messages and need one"
        )
    texts = [
        tokenizer.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False)
        for ex in examples
    ]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out = []
    for ex, seq in zip(examples, ids):
        if len(seq) > max_prompt_length:
            if truncation == "error":
                raise DataError(
                    f"prompt of example {ex.uid!r} has {len(seq)} tokens, more than "
                    f"max_prompt_length={max_prompt_length}; raise data.max_prompt_length, "
                    'shorten the prompt or set data.truncation = "left"'
                )
            seq = seq[-max_prompt_length:]
        out.append(list(seq))
    return out


def check_prompt_lengths(
    tokenizer: Any,
    examples: Sequence[Example],
    max_prompt_length: int,
    truncation: str = "error",
    chunk: int = 1024,
) -> int:
    """With `truncation="error"`, encode every prompt once (about 60 us each on CPU) so that an over-long
    one stops the run before it starts, naming the example, instead of at the step that draws it.
    Returns the longest prompt's token count (`max_prompt_length` when prompts are not encoded here)."""
    if truncation != "error" or not examples:
        return max_prompt_length
    longest = 0
    for i in range(0, len(examples), chunk):  # chunks: the token ids are dropped as we go
        ids = encode_prompts(tokenizer, examples[i : i + chunk], max_prompt_length, truncation)
        longest = max(longest, max(map(len, ids), default=0))
    return longest


def build_datasets(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """(train, test) examples: the configured files, or the synthetic task when `train_files` is empty."""
    if cfg.train_files:
        train = load_examples(cfg.train_files)
        test = load_examples(cfg.test_files) if cfg.test_files else []
        return train, test
    train, test = make_synthetic(
        cfg.synthetic, cfg.synthetic_train_size, cfg.synthetic_test_size, cfg.seed, **cfg.synthetic_options
    )
    return train, (load_examples(cfg.test_files) if cfg.test_files else test)
