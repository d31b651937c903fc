"""Supervised fine-tuning with the same TorchTitan trainer: `rl-tpu sft CONFIG`.

A demonstration is an `Example` plus its response text: `extra_info["response"]` when the data set
has one, else the ground truth as a string (for the synthetic arithmetic task, the bare answer "82").
The response is followed by the tokenizer's EOS so the model learns to stop. The loss is the token-mean
NLL of the response (`algorithm.policy_loss = "sft"`), through the same micro-batched, FSDP-sharded
train step as RL, so SFT and GRPO checkpoints are interchangeable.

A multi-turn demonstration (`extra_info["response_messages"]`: the messages after the prompt, e.g. an
assistant turn with a tool call, the tool's message, the final assistant turn) is laid out exactly as a
multi-turn rollout lays out a trajectory (rollout/multi_turn.py): each assistant turn is its text's ids
plus EOS, each run of other messages is the ids the chat template inserts for them (`ChatDelta`), and
the loss covers the assistant turns' tokens only. With `rollout.tools` set, the prompt and the inserted
messages are rendered with the tools' schemas, as the rollout renders them.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

from rl_tpu.config import AlgorithmConfig, Config, to_toml
from rl_tpu.data import Example, PromptLoader, build_datasets, check_prompt_lengths, encode_prompts
from rl_tpu.model_folder import load_tokenizer
from rl_tpu.rollout.tools import load_tools
from rl_tpu.types import TrainBatch


def demonstration(ex: Example) -> str:
    return str(ex.extra_info.get("response", ex.ground_truth))


def turns_ids(tok, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """The ids after the prompt for `messages` (assistant turns and the messages between them) and their
    loss mask (1 on the assistant turns' tokens, their EOS included): the layout of a multi-turn rollout."""
    from rl_tpu.rollout.multi_turn import ChatDelta

    delta = ChatDelta(tok, tools=tools)
    ids: list[int] = []
    mask: list[int] = []
    pending: list[dict] = []
    for m in messages:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            inserted = delta.ids(pending)
            ids += inserted
            mask += [0] * len(inserted)
            pending = []
        turn = tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids += turn
        mask += [1] * len(turn)
    if pending or not ids:
        raise ValueError("a multi-turn demonstration must end with an assistant turn")
    return ids, mask


@functools.lru_cache(maxsize=8)
def _schemas(specs: tuple[str, ...]) -> list[dict]:
    return load_tools(list(specs))[1]


def sft_batch(tok, examples: list[Example], cfg: Config) -> TrainBatch:
    if not any("response_messages" in ex.extra_info for ex in examples):
        prompts = encode_prompts(tok, examples, cfg.data.max_prompt_length, cfg.data.truncation)
        responses = [
            tok(demonstration(ex), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            for ex in examples
        ]
        zeros = [[0.0] * len(r) for r in responses]
        return TrainBatch.from_sequences(
            prompts, responses, tok.pad_token_id, advantages=zeros, old_log_probs=zeros
        )
    schemas = _schemas(tuple(cfg.rollout.tools)) if cfg.rollout.tools else None
    prompts, responses, masks = [], [], []
    for ex in examples:
        prompts.append(
            list(
                tok.apply_chat_template(
                    ex.messages, tools=schemas, tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
        )
        messages = ex.extra_info.get("response_messages") or [
            {"role": "assistant", "content": demonstration(ex)}
        ]
        ids, mask = turns_ids(tok, messages, schemas)
        responses.append(ids)
        masks.append([float(m) for m in mask])
    zeros = [[0.0] * len(r) for r in responses]
    return TrainBatch.from_sequences(
        prompts, responses, tok.pad_token_id, advantages=zeros, old_log_probs=zeros, response_mask=masks
    )


class SFTSession:
    """A trainer group fine-tuning on demonstrations, one optimizer step per `step()` call. Given a started
    `trainer` group (of the same shape), the session restarts it from `model_path` with `cfg.trainer`'s
    optimizer settings instead of starting one; `shutdown()` then leaves it to its owner."""

    def __init__(self, cfg: Config, model_path: str, tok: Any = None, trainer: Any = None):
        from rl_tpu.trainer import TrainerGroup

        self.cfg = cfg
        self.tok = tok if tok is not None else load_tokenizer(model_path, chat_template=True)
        self.algo = AlgorithmConfig(policy_loss="sft", loss_agg_mode="token-mean")
        self._owns_trainer = trainer is None
        if trainer is None:
            self.trainer = TrainerGroup(cfg, model_path)
        else:
            self.trainer = trainer
            trainer.restart_from(model_path, cfg.trainer)

    def step(self, examples: list[Example]) -> dict[str, float]:
        t = time.perf_counter()
        metrics = self.trainer.train_step(sft_batch(self.tok, examples, self.cfg), self.algo)
        return {
            "loss/sft": metrics.get("loss/policy", float("nan")),
            "time/train": time.perf_counter() - t,
            "actor/grad_norm": metrics.get("actor/grad_norm", float("nan")),
        }

    def restart_from(self, model_path: str) -> None:
        """Continue from `model_path`'s weights with a fresh optimizer and schedule, as a new session
        on that folder would (same trainer processes: no start-up)."""
        self.trainer.restart_from(model_path, self.cfg.trainer)

    def export(self, out_dir: str | Path) -> str:
        return self.trainer.export_hf(str(out_dir))

    def shutdown(self) -> None:
        if self._owns_trainer:
            self.trainer.shutdown()


def run_sft(cfg: Config) -> dict[str, Any]:
    """`trainer.total_steps` SFT steps over the training data; writes RUN_DIR/hf (a HF model folder) and,
    under trainer.lora, RUN_DIR/adapter (a PEFT folder; RUN_DIR/hf is the base with it merged in)."""
    from rl_tpu.cluster import start_ray
    from rl_tpu.metrics import MetricsLogger
    from rl_tpu.model_folder import ensure_model
    from rl_tpu.model_source import resolve_model_path

    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    cfg.model.path = resolve_model_path(cfg.model.path)  # a Hub id, GGUF file or catalog name: a local folder
    model_path = ensure_model(cfg, run_dir)
    tok = load_tokenizer(model_path, chat_template=True)  # input errors before Ray starts
    train_set, _ = build_datasets(cfg.data)
    check_prompt_lengths(tok, train_set, cfg.data.max_prompt_length, cfg.data.truncation)
    loader = PromptLoader(train_set, cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed)
    start_ray(cfg)
    session = SFTSession(cfg, model_path, tok)
    logger = MetricsLogger(run_dir, cfg.logging)
    try:
        for step in range(1, cfg.trainer.total_steps + 1):
            logger.log(step, session.step(next(loader)))
        out = session.export(run_dir / "hf")
        if cfg.trainer.lora.rank:  # the merged model above, and the adapters alone
            session.trainer.export_adapter(str(run_dir / "adapter"))
    finally:
        logger.close()
        session.shutdown()
    return {"run_dir": str(run_dir), "hf": out, "steps": cfg.trainer.total_steps}
