"""An example environment for `rollout.env` (docs/multi_turn.md): asks the model to try again until its
answer contains the row's ground truth, for at most `rollout.max_turns` turns.

    rl-tpu train examples/tiny_cpu.toml --rollout.env=examples/envs/retry.py:Retry --rollout.max_turns=3
"""


class Retry:
    def reset(self, sample: dict) -> list[dict]:
        # `sample` is the dataset row: data_source, messages, ground_truth, ability, extra_info, uid
        self.answer = str(sample["ground_truth"])
        return list(sample["messages"])

    def step(self, messages: list[dict]) -> tuple[list[dict], float | None, bool]:
        if self.answer in messages[-1]["content"]:
            return [], 1.0, True
        return [{"role": "user", "content": "That is not right. Try again."}], 0.0, False
