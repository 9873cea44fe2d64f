"""The whole stack learns: async GRPO on the `tiny` preset raises a reward, and shuffled rewards do not.

The task is deliberately easy (answer with digits) so that it fits a CI budget on two CPU cores.
"""

from __future__ import annotations

import random

from tests.digits import digit_fraction, digits_config, mean_reward, train

_NOISE = random.Random(0)


def shuffled_reward(task: dict, text: str) -> float:
    """The same reward on a random string of the same length: same scale, no signal."""
    noise = "".join(chr(_NOISE.randint(32, 126)) for _ in range(min(len(text), 8)))
    return digit_fraction(task, noise)


def test_reward_rises_with_real_rewards_and_not_with_shuffled_ones(tmp_path) -> None:
    learned = train(digits_config(tmp_path, "real", {"model": "tiny"}), digit_fraction)
    start, end = mean_reward(learned[:3]), mean_reward(learned[-5:])
    assert start < 0.3
    assert end > start + 0.4, (start, end)

    shuffled = train(digits_config(tmp_path, "shuffled", {"model": "tiny"}), shuffled_reward)
    s_start, s_end = mean_reward(shuffled[:3]), mean_reward(shuffled[-5:])
    assert s_end < s_start + 0.15, (s_start, s_end)
    assert end > s_end + 0.3
