"""Checks of the model folder a user names (`model.path`), made in the driver before Ray starts.

Without them a wrong folder fails deep inside transformers (an unknown architecture without a tokenizer
reads "You need to have sentencepiece or tiktoken installed"), inside vLLM, or inside a trainer actor's
constructor, where Ray turns it into a traceback that has lost the exception's type. Each check raises
`ModelError` naming the folder or the file and what is missing.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_tpu.errors import ModelError

if TYPE_CHECKING:
    from rl_tpu.config import Config

# the Hugging Face classes of the model types the trainer builds (rl_tpu/hf_config.py MODEL_TYPES), which
# vLLM serves natively
SERVED_TRAINER_ARCHS = {"Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"}
# Any one of these lets AutoTokenizer build a tokenizer; without them it guesses a class from
# config.json's model_type and fails with a message about sentencepiece.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_model_folder(
    path: str | Path, *, trainer: bool, engine: bool = False, key: str = "model.path"
) -> dict[str, Any]:
    """config.json of the folder, after checking it is a model folder this run can use: config.json
    (valid JSON), a tokenizer, with `trainer` an architecture the trainer builds and safetensors weights
    (what it loads), with `engine` an architecture this environment's vLLM serves (`rl-tpu generate`,
    whose engine runs in this process; a run's engines may run in another environment)."""
    folder, where = Path(path), f"{key} = {str(path)!r}"
    if not folder.is_dir():
        raise ModelError(f"{where}: no such folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{where} is not a Hugging Face model folder (no config.json)")
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{config_file}: not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ModelError(f"{config_file}: must hold a JSON object, got {type(hf).__name__}")
    if trainer:
        from rl_tpu.hf_config import check_hf_config

        check_hf_config(hf, config_file)
        if not any(folder.glob("*.safetensors")):
            raise ModelError(f"{where} has no *.safetensors weights (the trainer loads safetensors only)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(
            f"{where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
            "tokenizer files of the model it was made from"
        )
    if engine:
        check_engine_architecture(hf, config_file)
    return hf


def check_engine_architecture(hf: dict[str, Any], where: str | Path) -> None:
    """Raise `ModelError` naming `where` (the config.json) if none of its `architectures` is served by
    vLLM in this environment, natively or through its Transformers backend (a class transformers has):
    vLLM itself would stop with a validation error listing its ~400 architectures. Without vLLM here, or
    without `architectures`, there is nothing to check against and vLLM decides."""
    names = hf.get("architectures")
    if not isinstance(names, list) or not names or importlib.util.find_spec("vllm") is None:
        return
    served = _vllm_architectures()
    if any(n in served for n in names):
        return
    import transformers

    if any(isinstance(n, str) and hasattr(transformers, n) for n in names):
        return  # vLLM's Transformers backend may serve it; vLLM decides
    import vllm

    raise ModelError(
        f"{where}: architectures {names} (model_type {hf.get('model_type')!r}) is not served by vLLM "
        f"{vllm.__version__} here, natively or through its Transformers backend"
    )


def _vllm_architectures() -> set[str]:
    # vLLM logs notes while it imports ("Triton is installed, but doesn't include CPU backend") before it
    # sets up its logging, so they would reach stderr through logging's last resort, beside the one line
    # a user error gets: a handler on the `vllm` logger takes them while the registry imports
    quiet, vllm_log = logging.NullHandler(), logging.getLogger("vllm")
    vllm_log.addHandler(quiet)
    try:
        from vllm import ModelRegistry
    finally:
        vllm_log.removeHandler(quiet)
    return set(ModelRegistry.get_supported_archs())


def load_tokenizer(path: str | Path, *, chat_template: bool = False, key: str = "model.path") -> Any:
    """AutoTokenizer of the folder. Tokenizer files transformers cannot use, or no chat template when
    `chat_template` (RL and SFT prompts are chat messages), raise `ModelError` naming the folder."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:  # what transformers raises for unusable or missing tokenizer files
        raise ModelError(
            f"{key} = {str(path)!r}: its tokenizer cannot be loaded: {type(e).__name__}: {e}"
        ) from e
    if chat_template and not getattr(tok, "chat_template", None):
        raise ModelError(
            f"{key} = {str(path)!r}: the tokenizer has no chat template (prompts are chat "
            "messages); add `chat_template` to tokenizer_config.json or a chat_template.jinja"
        )
    return tok


def ensure_model(cfg: Config, run_dir: Path) -> str:
    """`model.path` (checked: a folder the trainer can build, with a tokenizer), or a tiny model built
    (once) into the run folder, built again when `model.arch`/`size`/`seed` changed since (a resumed
    checkpoint of the other model is then refused by `check_resume_model`)."""
    if cfg.model.path:
        hf = check_model_folder(cfg.model.path, trainer=True)
        names = hf.get("architectures") or []
        # the engines run vLLM of this environment unless rollout.python names another; the classes the
        # trainer's model types come as are served, so only another class costs vLLM's import here
        if not cfg.rollout.python and not set(names) <= SERVED_TRAINER_ARCHS:
            check_engine_architecture(hf, Path(cfg.model.path) / "config.json")
        return cfg.model.path
    out = run_dir / "model"
    want = {
        "arch": cfg.model.arch,
        "size": cfg.model.size,
        "seed": cfg.model.seed,
        "tie_embeddings": cfg.model.tie_embeddings,
    }
    made = out / "rl_tpu_tiny.json"
    if (out / "model.safetensors").is_file() and made.is_file():
        have = json.loads(made.read_text())
        have.setdefault("tie_embeddings", False)  # folders made before the option
        if {k: have.get(k) for k in want} != want:  # the run folder was used with another tiny model
            logging.getLogger("rl_tpu").warning(
                "%s holds a tiny model of %s, configured %s: building the configured one", out, have, want
            )
            import shutil

            shutil.rmtree(out)
    if not (out / "model.safetensors").is_file():
        from rl_tpu.tiny_model import make_tiny_model

        make_tiny_model(out, cfg.model.arch, cfg.model.size, cfg.model.seed, cfg.model.tie_embeddings)
    return str(out)
