"""Countdown: seeded generation, a reward that parses (never executes) replies, and the solver."""

from __future__ import annotations

import re

import pytest

from rllm_async.tasks.countdown import (
    FORMAT_REWARD,
    generator,
    parse,
    reward,
    solve,
    warm_start_examples,
)

TASK = {"id": "t", "numbers": [3, 5, 7], "target": 22, "prompt": "..."}


@pytest.mark.parametrize("text", ["3*5+7", " 7 + 5*3 ", "(5*3)+7", "7+(3*5)", "((3)*5)+7"])
def test_correct(text: str) -> None:
    assert reward(TASK, text) == (1.0, True)


@pytest.mark.parametrize("text", ["3+5+7", "(3+5)*7", "7-5*3"])
def test_wrong_value_gets_format_credit(text: str) -> None:
    assert reward(TASK, text) == (FORMAT_REWARD, False)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "22",  # the target alone
        "3*5+7+7",  # a number used twice
        "3*5",  # a number unused
        "3*5+8",  # a number not given
        "3*5+7 = 22",
        "3**5+7",
        "3*(5+7",
        "3*5+7)",
        "-3*5+7",
        "3/5+7",
        "3 5 7",
        "(" * 40 + "3*5+7" + ")" * 40,
        "3*5+７",  # a full-width digit
        "1" * 100,
    ],
)
def test_malformed(text: str) -> None:
    assert reward(TASK, text) == (0.0, False)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('echo pwned')",
        "eval('3*5+7')",
        "3*5+7; import os",
        "().__class__.__bases__[0].__subclasses__()",
        "\x00\ud800",
        None,
        ["3*5+7"],
    ],
)
def test_hostile_input_scores_zero_and_never_raises(text: object) -> None:
    assert reward(TASK, text) == (0.0, False)  # type: ignore[arg-type]


def test_parser_respects_precedence() -> None:
    assert parse("2+3*4") == ("+", 2, ("*", 3, 4))
    assert parse("(2+3)*4") == ("*", ("+", 2, 3), 4)
    assert parse("8-3-2") == ("-", ("-", 8, 3), 2)


def test_generator_is_seeded_and_every_task_is_solvable() -> None:
    tasks = generator(n=50, seed=3)
    assert tasks == generator(n=50, seed=3)
    assert tasks != generator(n=50, seed=4)
    assert len({t["id"] for t in tasks}) == 50
    for task in tasks:
        assert 3 <= len(task["numbers"]) <= 4 and all(1 <= x <= 9 for x in task["numbers"])
        assert 0 < task["target"] <= 99
        assert str(task["target"]) in task["prompt"]
    examples = warm_start_examples(n=50, seed=3)
    assert len(examples) == 50
    for task, ex in zip(tasks, examples, strict=True):
        assert reward(task, ex["solution"]) == (1.0, True)
        assert ex["messages"][-1] == {"role": "assistant", "content": ex["solution"]}


def test_solver_renders_needed_parentheses_and_knows_unsolvable() -> None:
    assert solve([2, 3, 4], 20) in ("(2+3)*4", "4*(2+3)", "(3+2)*4", "4*(3+2)")
    assert solve([1, 1, 1], 50) is None
    assert reward({"numbers": [9, 2, 4], "target": 3}, solve([9, 2, 4], 3) or "") == (1.0, True)


def test_warm_start_mixes_solutions_with_well_formed_guesses() -> None:
    tasks = generator(n=400, seed=1, min_numbers=2, max_numbers=3)
    mixed = warm_start_examples(n=400, seed=1, solved_share=0.3, min_numbers=2, max_numbers=3)
    assert mixed == warm_start_examples(
        n=400, seed=1, solved_share=0.3, min_numbers=2, max_numbers=3
    )
    scores = [reward(t, ex["solution"]) for t, ex in zip(tasks, mixed, strict=True)]
    # Every answer uses the problem's numbers once each; a guess is right only by chance.
    assert all(score > 0.0 for score, _ in scores)
    share_correct = sum(ok for _, ok in scores) / len(scores)
    assert 0.3 < share_correct < 0.6
    assert sum(ex["messages"][-1]["content"] == ex["solution"] for ex in mixed) == 400
    solved = warm_start_examples(n=400, seed=1, min_numbers=2, max_numbers=3)
    assert all(
        reward(t, ex["solution"]) == (1.0, True) for t, ex in zip(tasks, solved, strict=True)
    )


def test_balanced_warm_start_gives_every_operation_its_share() -> None:
    kwargs = {"min_numbers": 2, "max_numbers": 3}
    balanced = warm_start_examples(n=600, seed=1, balance_operations=True, **kwargs)
    assert balanced == warm_start_examples(n=600, seed=1, balance_operations=True, **kwargs)
    assert len({ex["id"] for ex in balanced}) == 600
    kinds: dict[tuple[int, str], int] = {}
    for ex in balanced:
        numbers, target = _problem(ex["messages"][0]["content"])
        assert reward({"numbers": numbers, "target": target}, ex["solution"]) == (1.0, True)
        if len(numbers) == 2:
            kind = next(op for op in "+-*" if op in ex["solution"])
        else:
            kind = "-" if "-" in ex["solution"] else "no -"
        kinds[(len(numbers), kind)] = kinds.get((len(numbers), kind), 0) + 1
    assert kinds == {(2, "+"): 100, (2, "-"): 100, (2, "*"): 100, (3, "-"): 150, (3, "no -"): 150}
    # Left to the generator, two-number problems are mostly sums and seldom differences.
    plain = warm_start_examples(n=600, seed=1, **kwargs)
    two = [ex["solution"] for ex in plain if len(_problem(ex["messages"][0]["content"])[0]) == 2]
    assert sum("-" in s for s in two) < 0.25 * len(two)
    assert sum("+" in s for s in two) > 0.4 * len(two)


def _problem(prompt: str) -> tuple[list[int], int]:
    """(numbers, target) back from a prompt such as 'Use 7 1 5 and + - * to make 40.'."""
    match = re.fullmatch(r"Use ([\d ]+) and \+ - \* to make (\d+)\.", prompt)
    assert match is not None, prompt
    return [int(x) for x in match[1].split()], int(match[2])


def test_balancing_names_the_share_it_cannot_fill() -> None:
    # With numbers 1-2 no product is a fresh target (1*1 and 2*1 repeat a number, 2*2 is 2+2).
    with pytest.raises(ValueError, match="could not balance"):
        warm_start_examples(
            n=30, balance_operations=True, min_numbers=2, max_numbers=2, max_number=2
        )
