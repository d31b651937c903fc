"""The trainer's own math on `xla:0`, run by tests/integration/test_devices.py inside .venv-xla (torch 2.9,
torch_xla 2.9, PJRT_DEVICE=CPU); prints one JSON line of measurements.

What is real here: `Device.init()` for the xla row, the `xla` torch.distributed process group (one rank,
`parallel.init_process_group`), `TrainBatch.pad_to` with `ops.static_buckets`, `ops.response_index`,
`ops.chunked_log_probs` (forward and backward), `compute_policy_loss` (PPO clip, token-mean, with
the engine's log-probs for mismatch/kl), AdamW, the metrics kept as device tensors and all-reduced and read
once per step as the trainer's `_reduce` does. What is NOT: the model. The trainer's TorchTitan 0.3.0
model does not build on torch 2.9 (docs/devices.md), so a one-layer stand-in (embedding, linear, tanh)
feeds the log-prob head. The same steps run eagerly on the CPU in this process for comparison.
"""

from __future__ import annotations

import json
import socket
import sys

import torch

from rl_tpu.algorithms.losses import compute_policy_loss
from rl_tpu.config import AlgorithmConfig
from rl_tpu.devices import get_device
from rl_tpu.trainer import ops, parallel
from rl_tpu.types import TrainBatch

V, D, CHUNK, MICRO = 96, 16, 32, 2
# (prompt lengths, response lengths) of each step: the buckets (L, T) alternate A, B, A, B, A, B with
# different real lengths every time, so a recompilation after a bucket's first step would show
# (bucket A: L <= 16, T <= 16; bucket B: L and T in (16, 32])
STEPS = [
    ([3, 5, 4, 2], [4, 6, 2, 5]),
    ([9, 12, 7, 10], [18, 9, 13, 6]),
    ([4, 2, 6, 3], [5, 3, 7, 2]),
    ([11, 8, 10, 3], [12, 15, 8, 20]),
    ([2, 3, 5, 4], [6, 2, 4, 7]),
    ([10, 9, 2, 7], [13, 11, 22, 15]),
]
MAX_LEN = 32


def make_batch(step: int) -> TrainBatch:
    g = torch.Generator().manual_seed(100 + step)
    plens, rlens = STEPS[step]
    P = [torch.randint(1, V, (n,), generator=g).tolist() for n in plens]
    R = [torch.randint(1, V, (n,), generator=g).tolist() for n in rlens]
    adv = torch.randn(len(P), generator=g).tolist()
    roll = [(-torch.rand(n, generator=g) * 3).tolist() for n in rlens]
    return TrainBatch.from_sequences(P, R, pad_id=0, advantages=adv, rollout_log_probs=roll)


class StandIn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(V, D, generator=g) * 0.5)
        self.lin = torch.nn.Parameter(torch.randn(D, D, generator=g) * 0.3)
        self.head = torch.nn.Parameter(torch.randn(V, D, generator=g) * 0.5)

    def forward(self, ids, hidx, targets):
        h = torch.tanh(self.emb[ids] @ self.lin)
        hs = h.gather(1, hidx[..., None].expand(-1, -1, D))
        return ops.chunked_log_probs(hs, self.head, targets, CHUNK)


def run(device: torch.device, sync, reduce) -> tuple[list[dict[str, float]], dict[str, torch.Tensor], list]:
    model = StandIn().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    algo = AlgorithmConfig()
    buckets = ops.static_buckets(MAX_LEN)
    out, shapes = [], []
    for step in range(len(STEPS)):
        b = make_batch(step)
        g_tok = float(b.response_mask.sum())
        b = b.pad_to(
            ops.bucket_length(b.input_ids.shape[1], buckets), ops.bucket_length(b.response_len, buckets), 0
        )
        shapes.append(tuple(b.response_mask.shape) + (b.input_ids.shape[1],))
        sums: dict[str, torch.Tensor] = {}
        for rows in torch.arange(b.num_seqs).split(MICRO):
            mb = b.select(rows)
            ids = mb.input_ids.to(device)
            hidx, tidx = ops.response_index(mb.prompt_lens.to(device), mb.response_len, ids.shape[1])
            lp, _ = model(ids, hidx, ids.gather(1, tidx))
            loss, metrics = compute_policy_loss(
                algo,
                lp,
                lp.detach(),
                mb.advantages.to(device),
                mb.response_mask.to(device),
                rollout_log_prob=mb.rollout_log_probs.to(device),
                global_tokens=g_tok,
            )
            loss.backward()
            for k, v in metrics.items():
                v = v.to(torch.float64)
                sums[k] = sums[k] + v if k in sums else v
        opt.step()
        opt.zero_grad(set_to_none=True)
        keys = sorted(sums)
        vec = torch.stack([sums[k] for k in keys])
        reduce(vec)
        sync()  # end of the step's graph (XLA); the single read of the step's metrics follows
        out.append(dict(zip(keys, vec.cpu().tolist())))
    return out, {n: p.detach().cpu() for n, p in model.named_parameters()}, shapes


def main() -> None:
    import torch.distributed as dist
    import torch_xla
    import torch_xla.debug.metrics as met

    device = get_device("xla")
    device.init()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel.init_process_group(device, 0, 1, "127.0.0.1", port)
    backend = dist.get_backend()
    local = device.local_device()

    def counts() -> tuple[int, int]:
        c, t = met.metric_data("CompileTime"), met.metric_data("TransferFromDeviceTime")
        return (c[0] if c else 0), (t[0] if t else 0)

    step_counts = []  # (compilations, device-to-host transfers) so far, after each step's sync

    def sync_and_count():
        torch_xla.sync()
        step_counts.append(counts())

    xla_out, xla_params, shapes = run(local, sync_and_count, lambda v: dist.all_reduce(v))
    final = counts()  # the last step's metrics read and the 3 parameter reads included
    cpu_out, cpu_params, _ = run(torch.device("cpu"), lambda: None, lambda v: None)
    diffs = {k: float((xla_params[k] - cpu_params[k]).abs().max()) for k in cpu_params}
    metric_diffs = [max(abs(a[k] - c[k]) for k in c) for a, c in zip(xla_out, cpu_out)]
    print(
        json.dumps(
            {
                "backend": backend,
                "device": str(local),
                "torch": torch.__version__,
                "torch_xla": torch_xla.__version__,
                "shapes": shapes,
                "compiles_after_step": [c for c, _ in step_counts],
                "compiles_final": final[0],
                "transfers_after_step": [t for _, t in step_counts],
                "transfers_final": final[1],
                "param_max_diff": max(diffs.values()),
                "metric_max_diff": max(metric_diffs),
                "metrics_last": xla_out[-1],
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
