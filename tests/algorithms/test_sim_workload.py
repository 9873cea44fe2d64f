"""The simulated workload's draws: fixed by their key, inside (0, 1), the same by either path."""

from __future__ import annotations

import random

from rllm_async.algorithms.sim_workload import rollout_uniforms, uniforms


def test_a_rollouts_draws_are_the_keyed_uniforms_of_its_attempt() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        key = (
            rng.randrange(100),
            f"task-{rng.randrange(10**6)}",
            rng.randrange(64),
            rng.randrange(3),
        )
        draws = rollout_uniforms(*key)
        assert list(draws) == uniforms(*key, n=4)
        assert all(0.0 < u < 1.0 for u in draws)


def test_draws_depend_on_every_part_of_the_key() -> None:
    base = rollout_uniforms(0, "t", 1, 0)
    assert base == rollout_uniforms(0, "t", 1, 0)
    for other in [(1, "t", 1, 0), (0, "u", 1, 0), (0, "t", 2, 0), (0, "t", 1, 1)]:
        assert rollout_uniforms(*other) != base
