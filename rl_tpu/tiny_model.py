"""Build a tiny Hugging Face model folder locally: config.json, safetensors weights, a fast tokenizer.

No network: the tokenizer is a byte-level BPE trained here with the `tokenizers` library on a corpus
generated from this file, with digits split one per token (so arithmetic tasks are learnable by small
models) and a Qwen-style chat template. Everything is deterministic for a seed: the corpus is fixed,
BPE training is deterministic, and the weights come from `torch.manual_seed(seed)`.

Sizes: `tiny` (~0.5 M parameters) for tests and the demo, `mini` (~3.4 M) and `small` (~13 M) for
benchmarks and a slower demo.

Architectures (`ARCHS`): dense `qwen3` and `llama`, and `qwen3_moe` (Qwen3MoeForCausalLM): every layer
sparse, `MOE["num_experts"]` routed experts of width `intermediate_size // 2`, top-`MOE["top_k"]` softmax
routing renormalised over the chosen experts (`norm_topk_prob`, as the released Qwen3-MoE models), no
shared expert. Same tokenizer and attention dimensions as the dense model of that size.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
EOS, PAD = "<|im_end|>", "<|pad|>"

# Qwen-style template; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ARCHS = ("qwen3", "llama", "qwen3_moe")
MOE = dict(num_experts=4, top_k=2)

SIZES = {
    #            hidden layers heads kv_heads intermediate vocab
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
        vocab_size=512,
    ),
    "mini": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=768,
        vocab_size=512,
    ),
    "small": dict(
        hidden_size=384,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=1024,
        vocab_size=512,
    ),
    # ~100 M parameters: a trainer shape for benchmarks (bench/trainer.py), not for the demos
    "medium": dict(
        hidden_size=768,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=512,
    ),
}

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has "
    "look two more write go see number no way could people my than first water been call who oil its "
    "now find long down day did get come made may part answer question think step sum add plus minus "
    "times equals result target numbers use reach make correct wrong because therefore final"
).split()


def _corpus(seed: int = 1234) -> list[str]:
    """Fixed text the tokenizer is trained on: chat markup, arithmetic and common English words."""
    rng = random.Random(seed)
    lines = []
    for _ in range(4000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        lines.append(f"What is {a} {op} {b}? The answer is {eval(f'{a}{op}{b}')}.")
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))))
        lines.append(f"<answer>{rng.randint(0, 9999)}</answer> ({a}+{b})*{rng.randint(1, 9)}=")
    lines += ["system", "user", "assistant", "\n"]
    return lines


def build_tokenizer(vocab_size: int):
    """A byte-level BPE with single-digit tokens, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(
    arch: str, size: str, vocab_size: int, eos_id: int, pad_id: int, tie_embeddings: bool = False
):
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    dims = dict(SIZES[size], vocab_size=vocab_size)
    common = dict(
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie_embeddings,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        torch_dtype="float32",
        head_dim=dims["hidden_size"] // dims["num_attention_heads"],
    )
    if arch == "qwen3":
        return Qwen3Config(**dims, **common, attention_bias=False)
    if arch == "llama":
        return LlamaConfig(**dims, **common, attention_bias=False, mlp_bias=False)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **dims,
            **common,
            attention_bias=False,
            num_experts=MOE["num_experts"],
            num_experts_per_tok=MOE["top_k"],
            moe_intermediate_size=dims["intermediate_size"] // 2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            output_router_logits=False,
        )
    raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")


def make_tiny_model(
    out: str | Path, arch: str = "qwen3", size: str = "tiny", seed: int = 0, tie_embeddings: bool = False
) -> Path:
    """Write a complete Hugging Face model folder to `out` and return its path. `tie_embeddings`: one
    tensor for the input embedding and the output head (`tie_word_embeddings`, as most small open models:
    the safetensors then hold no `lm_head.weight`)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(SIZES[size]["vocab_size"])
    vocab = len(tok)
    config = build_config(
        arch, size, vocab, tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(PAD), tie_embeddings
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    meta = {
        "arch": arch,
        "size": size,
        "seed": seed,
        "tie_embeddings": tie_embeddings,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "rl_tpu_tiny.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out
