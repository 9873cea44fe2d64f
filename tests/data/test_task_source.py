"""TaskSource: order, and skipping tasks that keep coming back solved."""

from __future__ import annotations

import itertools
import json
from typing import Any

from rllm_async.data import TaskSource


def source(tasks: list[dict[str, Any]], *, skip_solved: bool = True) -> TaskSource:
    return TaskSource(tasks, seed=0, shuffle=False, total_epochs=None, skip_solved=skip_solved)


def serve(src: TaskSource, draws: int, solved: set[str]) -> list[str]:
    """Pop `draws` tasks, ending each one's group at once: solved when its id is in `solved`."""
    served = []
    for _ in range(draws):
        task = src.pop()
        assert task is not None
        src.group_ended(task, solved=task["id"] in solved)
        served.append(task["id"])
    return served


def skips_between_serves(served: list[str], task_id: str) -> list[int]:
    """How many draws of `task_id` were skipped between its serves, with two tasks in a fixed
    order: every pass over them serves the other one, so n skips leave n + 1 of it in between."""
    at = [i for i, t in enumerate(served) if t == task_id]
    return [b - a - 2 for a, b in itertools.pairwise(at)]


TWO = [{"id": "x", "q": 1}, {"id": "y", "q": 2}]


def test_a_task_solved_again_and_again_is_skipped_twice_as_long_each_time_up_to_a_cap() -> None:
    src = source(TWO)
    served = serve(src, 200, solved={"x"})
    assert skips_between_serves(served, "x") == [1, 2, 4, 8, 16] + [32] * 4
    draws = 2 * src.epoch + src.cursor
    assert src.take_skipped() == draws - len(served)
    assert src.take_skipped() == 0, "counted since the last call"


def test_a_group_that_is_not_all_solved_ends_the_skipping() -> None:
    src = source(TWO)
    assert serve(src, 8, solved={"x"}) == ["x", "y", "y", "x", "y", "y", "y", "x"]
    # x was solved three times in a row: its next four draws are skipped. Then it fails.
    assert serve(src, 20, solved=set()) == ["y"] * 5 + ["x", "y"] * 7 + ["x"]


def test_tasks_with_the_same_content_and_different_ids_share_a_streak() -> None:
    tasks = [{"id": "a1", "q": 1}, {"id": "a2", "q": 1}, {"id": "b", "q": 2}]
    src = source(tasks)
    assert serve(src, 1, solved={"a1"}) == ["a1"]
    assert serve(src, 2, solved=set()) == ["b", "a1"], "a2 is skipped: it is a1's problem"


def test_without_skip_solved_every_task_is_served_in_order() -> None:
    src = source(TWO, skip_solved=False)
    assert serve(src, 10, solved={"x", "y"}) == ["x", "y"] * 5
    assert src.take_skipped() == 0


def test_the_streaks_survive_a_checkpoint() -> None:
    src = source(TWO)
    serve(src, 15, solved={"x"})
    resumed = source(TWO)
    resumed.load_state(json.loads(json.dumps(src.state(pending=[]))))
    assert serve(resumed, 60, solved={"x"}) == serve(src, 60, solved={"x"})
