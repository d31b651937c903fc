"""Prompt data in verl's schema: files (parquet, JSONL), synthetic tasks, batching and encoding.

train, test = build_datasets(cfg.data)            # files, or the synthetic task
loader = PromptLoader(train, cfg.data.batch_size, cfg.data.shuffle, cfg.data.seed)
ids = encode_prompts(tokenizer, next(loader), cfg.data.max_prompt_length, cfg.data.truncation)
"""

from rl_tpu.data.files import load_examples, write_jsonl, write_parquet
from rl_tpu.data.loader import PromptLoader, build_datasets, check_prompt_lengths, encode_prompts
from rl_tpu.data.schema import DataError, Example
from rl_tpu.data.synthetic import dump_synthetic, make_synthetic

__all__ = [
    "DataError",
    "Example",
    "PromptLoader",
    "build_datasets",
    "check_prompt_lengths",
    "dump_synthetic",
    "encode_prompts",
    "load_examples",
    "make_synthetic",
    "write_jsonl",
    "write_parquet",
]
