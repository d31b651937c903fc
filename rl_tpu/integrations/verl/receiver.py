"""`VerlWeightReceiver`: the vLLM worker extension a verl rollout runs with the `rl_tpu` checkpoint backend
(`actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=` this class's qualified name).

It is verl's own extension (`vLLMColocateWorkerExtension`: LoRA, fp8 and the full-tensor
`update_weights_from_ipc` keep working) plus ours (`rollout.worker_extension.WorkerExtension`: the plan-based
`rl_ws_*` methods). Imported only inside vLLM worker processes (it imports vLLM through verl).

`update_weights_from_ipc` is the call verl makes on every vLLM worker per weight update
(vllm_rollout.py:229, `ServerAdapter.update_weights`). Once our plan is set up on this worker, the stream
verl sends carries exactly one control record (`checkpoint.RECORD`: version and bucket handles from
`RlTpuCheckpointEngine.receive_weights`) and no weights; this worker then copies the pieces of its TP
rank's buckets into its parameters (`EngineSide`'s rl_ws_begin, rl_ws_receive, rl_ws_finish). verl's own final step,
`process_weights_after_loading` over the whole model (utils.py:353), is not run: our install already
processed each layer once, and on CPU a second repack of a processed layer is wrong. Without a plan
(another backend, e.g. `naive`), verl's method runs unchanged.
"""

from __future__ import annotations

import json
import os
import pickle

import torch
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from rl_tpu.rollout.worker_extension import WorkerExtension


class VerlWeightReceiver(WorkerExtension, vLLMColocateWorkerExtension):
    def rl_verl_derive(self, hf_specs: list, prefix: str) -> None:
        """Derive this rank's engine layout and write it to `<prefix>.<tp rank>` (verl's server drops
        return values)."""
        from rl_tpu.weight_sync import vllm_compat

        out = self.rl_ws_derive(hf_specs)
        path = f"{prefix}.{vllm_compat.tp_rank()}"
        with open(path + ".part", "wb") as f:
            pickle.dump(out, f)
        os.replace(path + ".part", path)

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        if not self._rl_ws.buckets:  # no rl_tpu plan on this worker: verl's full-tensor path
            return super().update_weights_from_ipc(
                peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm
            )
        if peft_config:
            raise NotImplementedError("rl_tpu checkpoint backend: LoRA adapters are not synced by plan")
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        from rl_tpu.integrations.verl.checkpoint import RECORD

        records: list[bytes] = []

        def on_bucket(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
            for name, t in weights:
                if name != RECORD:
                    raise RuntimeError(
                        f"rl_tpu checkpoint backend: verl's stream carried the full tensor {name!r}; "
                        "with a plan set up only its control record is expected"
                    )
                records.append(bytes(t.cpu().numpy()))  # copied out: verl reuses the stream's buffer

        device = getattr(self, "device", None) or torch.device("cpu")
        BucketedWeightReceiver(
            zmq_handle=self._get_zmq_handle(), device=device, use_shm=use_shm
        ).receive_weights(on_bucket_received=on_bucket)
        if len(records) != 1:
            raise RuntimeError(
                f"rl_tpu checkpoint backend: expected one control record in the stream, got {len(records)}"
            )
        rec = json.loads(records[0])
        self.rl_ws_begin(int(rec["version"]), bool(rec.get("keep", False)), None)
        self.rl_ws_receive(rec["handles"])
        self._rl_last_ack = self.rl_ws_finish()  # raises naming any parameter that did not fully arrive
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, reset, None)  # what vLLM's own reload resets too
            if fn is not None:
                fn()
