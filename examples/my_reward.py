"""An example user reward: swap it in with one line of config, no package needed.

    rl-tpu train --reward.functions='["examples/my_reward.py:compute_score"]'

or next to a built-in, weighted:

    [reward]
    functions = ["rl_tpu.rewards.arithmetic:compute_score", "examples/my_reward.py:compute_score"]
    weights = [1.0, 0.2]

It has verl's signature, so the same file works as verl's `custom_reward_function.path`. It returns a
dict: "score" is the reward, the other numbers are logged as reward/my_reward/<key>. The file is
imported inside each reward worker process at startup, outside the per-call timeout (`reward.timeout_s`),
so put heavy imports at the top, not inside the function. It may also be `async def` (e.g. to call a
judge model over HTTP).
"""

from rl_tpu.rewards.arithmetic import extract_answer


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Correct integer answer, minus a small penalty per character beyond a short answer."""
    correct = extract_answer(solution_str) == int(str(ground_truth))
    excess = max(0, len(solution_str.strip()) - 8)
    return {
        "score": float(correct) - 0.01 * min(excess, 50),
        "correct": float(correct),
        "length": float(len(solution_str)),
    }
