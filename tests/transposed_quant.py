"""A test-only vLLM linear method whose kernel layout differs from its loaded layout the way vLLM-TorchTPU's
does: `process_weights_after_loading` transposes every linear weight to `[in, out]` and pads the output dim
with zero columns to a multiple of `pad`; `apply` multiplies `x @ W[in, out_padded]` and drops the padding.
With `pad` 0 it keeps the loaded layout (processing leaves the weights as they are, `apply` is
`F.linear`), and with `live_head` the embeddings and LM head compute with their live weight too (vLLM's
CUDA behaviour; on CPU vLLM packs the LM head into a copy): an engine whose install path is `direct`, as
an unquantized CUDA engine's should be.

Registered through vLLM's public registry (`register_quantization_config`) when this module is imported, so
it works for an engine whose workers run in the importing process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, TP 1):
pass `engine_kwargs(pad)` to `vllm.LLM`. Embeddings, the LM head and attention keep vLLM's own methods.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

NAME = "rl_tpu_transposed"


def engine_kwargs(pad: int, live_head: bool = False) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments selecting this method with output padding to a multiple of `pad`."""
    return {
        "quantization": NAME,
        "hf_overrides": {"quantization_config": {"quant_method": NAME, "pad": pad, "live_head": live_head}},
    }


class LiveEmbeddingMethod(UnquantizedEmbeddingMethod):
    """vLLM's embedding method as it behaves on CUDA: no processing, the LM head multiplies by the live
    weight."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.weight, bias)


class TransposedLinearMethod(LinearMethodBase):
    def __init__(self, pad: int):
        self.pad = pad

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        # the loaded layout is vLLM's unquantized one: [out, in]
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # as vllm-torchtpu's dense linears: transpose once, mark the layer, and skip a marked layer
        # (vllm_torchtpu/layers/adapter/quantization/unquantized.py), so a reload must clear the mark
        if getattr(layer, "_tpu_weight_flipped", False) or not self.pad:
            return
        w = layer.weight.data
        out, inp = w.shape
        kernel = w.new_zeros(inp, -(-out // self.pad) * self.pad)
        kernel[:, :out] = w.t()
        layer.weight = torch.nn.Parameter(kernel, requires_grad=False)  # a new parameter, as TorchTPU's
        layer._tpu_weight_flipped = True

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.pad:
            return torch.nn.functional.linear(x, layer.weight, bias)
        y = torch.matmul(x, layer.weight)[..., : layer.output_size_per_partition]
        return y if bias is None else y + bias


@register_quantization_config(NAME)
class TransposedConfig(QuantizationConfig):
    def __init__(self, pad: int = 64, live_head: bool = False):
        super().__init__()
        self.pad, self.live_head = pad, live_head

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TransposedConfig:
        return cls(int(config.get("pad", 64)), bool(config.get("live_head", False)))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            return TransposedLinearMethod(self.pad)
        return LiveEmbeddingMethod() if self.live_head and isinstance(layer, VocabParallelEmbedding) else None
