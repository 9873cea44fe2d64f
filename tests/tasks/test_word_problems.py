"""rllm_async.tasks.word_problems: the generator (deterministic, right answers, disjoint splits)
and the reward's parsing of replies, hostile ones included. No model."""

from __future__ import annotations

import re
import time

import pytest

from rllm_async.tasks import word_problems as wp
from rllm_async.workflows.prompt import task_messages

# Each kind's answer from the numbers of its question text, in the order the text gives them.
SOLVE = {
    "total": lambda n: n[0] + n[1],
    "price": lambda n: n[0] * n[1],
    "share": lambda n: n[0] // n[1],
    "left": lambda n: n[0] - n[1],
    "age": lambda n: n[0] + n[1],
    "age_ago": lambda n: n[0] - n[1],
    "more_then_give": lambda n: n[0] + n[1] - n[2],
    "change": lambda n: n[2] - n[0] * n[1],
}


def test_every_template_has_an_independent_solver() -> None:
    assert set(SOLVE) == set(wp.TEMPLATES)


def test_the_generator_is_deterministic() -> None:
    a = wp.generator(200, seed=5)
    assert a == wp.generator(200, seed=5)
    assert a != wp.generator(200, seed=6)
    assert wp.generator(50, seed=5) == a[:50]


@pytest.mark.parametrize("max_number", [4, 10, 20, 60])
def test_answers_are_right_and_positive_integers(max_number: int) -> None:
    for task in wp.generator(800, seed=3, max_number=max_number, split="all"):
        numbers = [int(x) for x in re.findall(r"\d+", task["question"])]
        answer = SOLVE[task["kind"]](numbers)
        assert task["answer"] == answer, task["question"]
        assert isinstance(task["answer"], int) and task["answer"] > 0
        if task["kind"] == "share":
            assert numbers[0] % numbers[1] == 0, task["question"]
        if task["kind"] in ("total", "age"):
            assert max(numbers) <= max_number


def test_kinds_come_in_equal_shares_and_can_be_chosen() -> None:
    tasks = wp.generator(160, seed=0)
    counts = {k: sum(t["kind"] == k for t in tasks) for k in wp.TEMPLATES}
    assert set(counts.values()) == {160 // len(wp.TEMPLATES)}
    only = wp.generator(30, seed=0, kinds=["total", "share"])
    assert {t["kind"] for t in only} == {"total", "share"}
    with pytest.raises(ValueError, match="unknown kinds"):
        wp.generator(3, kinds=["nope"])
    with pytest.raises(ValueError, match="split"):
        wp.generator(3, split="validation")


def _kind_of(question: str) -> str:
    """The template that wrote `question`, from its wording."""
    marks = {
        "in total?": "total",
        "pay?": "price",
        "equally among": "share",
        "have left?": "left",
        "years older": "age",
        "years ago?": "age_ago",
        "more, then gives": "more_then_give",
        "of change": "change",
    }
    (kind,) = [k for mark, k in marks.items() if mark in question]
    return kind


@pytest.mark.parametrize("example", wp.EXAMPLES)
def test_each_prompt_is_a_chat_with_one_right_worked_example(example: str) -> None:
    tasks = wp.generator(240, seed=1, example=example, split="all")
    assert len({t["id"] for t in tasks}) == len(tasks)
    for task in tasks:
        chat = task_messages(task, "prompt", None)
        assert [m["role"] for m in chat] == ["user", "assistant", "user"]
        assert chat[-1]["content"] == task["question"]
        assert _kind_of(task["question"]) == task["kind"]
        shown_q, shown_a = chat[0]["content"], chat[1]["content"]
        assert shown_q != task["question"]
        if example == "fixed":
            assert (shown_q, shown_a) == (wp.EXAMPLE_QUESTION, wp.EXAMPLE_ANSWER)
            continue
        # The example answers its own question correctly, in the format the reward reads.
        kind = _kind_of(shown_q)
        numbers = [int(x) for x in re.findall(r"\d+", shown_q)]
        assert wp.reward({"answer": SOLVE[kind](numbers)}, shown_a) == (1.0, True)
        if example != "mixed":
            assert (kind == task["kind"]) == (example == "kind")
        # The example is never a held-out problem, so the eval set's answers are never shown.
        assert not wp.heldout(f"{kind}:{','.join(map(str, numbers))}")
    if example == "mixed":
        same = sum(_kind_of(t["prompt"][0]["content"]) == t["kind"] for t in tasks)
        assert 0.35 < same / len(tasks) < 0.65
    assert wp.parse_answer(wp.EXAMPLE_ANSWER) == 13 == 3 * 6 - 5
    with pytest.raises(ValueError, match="example"):
        wp.generator(3, example="none")


def test_the_key_is_the_kind_and_the_numbers_of_the_question() -> None:
    for task in wp.generator(200, seed=4, split="all"):
        numbers = [int(x) for x in re.findall(r"\d+", task["question"])]
        assert task["key"] == f"{task['kind']}:{','.join(map(str, numbers))}"


def test_held_out_and_training_problems_are_disjoint() -> None:
    train = wp.generator(5000, seed=1, split="train")
    test = wp.generator(128, seed=2, split="test", unique=True)
    assert not {t["key"] for t in train} & {t["key"] for t in test}
    assert not {t["question"] for t in train} & {t["question"] for t in test}
    assert all(wp.heldout(t["key"]) for t in test)
    assert not any(wp.heldout(t["key"]) for t in train)
    assert len({t["key"] for t in test}) == 128  # unique
    # Same seeds, other split: still disjoint; the same seed and split: the same problems.
    assert not {t["key"] for t in wp.generator(500, seed=2, split="train")} & {
        t["key"] for t in test
    }


def test_asking_for_more_unique_problems_than_exist_fails_with_a_message() -> None:
    with pytest.raises(ValueError, match="could not draw"):
        wp.generator(500, seed=0, max_number=4, kinds=["total"], split="test", unique=True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12 + 30 = 42.\n#### 42", (1.0, True)),
        ("#### 42", (1.0, True)),
        ("####42", (1.0, True)),
        ("So the answer is\n#### $42 dollars", (1.0, True)),
        ("#### 42.00", (1.0, True)),
        ("#### 1,042", (0.1, False)),  # parsed as 1042: wrong, but in the format
        ("#### 41", (wp.FORMAT_REWARD, False)),
        ("#### 42.5", (0.0, False)),  # not an integer
        ("#### 13\nWait, no.\n#### 42", (1.0, True)),  # the last answer counts
        ("#### 42\n#### 41", (wp.FORMAT_REWARD, False)),
        ("The answer is 42.", (0.0, False)),  # no marker
        ("####", (0.0, False)),
        ("#### forty-two", (0.0, False)),
        ("", (0.0, False)),
        ("#### -42", (wp.FORMAT_REWARD, False)),
    ],
)
def test_reward_parses_the_final_answer(text: str, expected: tuple[float, bool]) -> None:
    assert wp.reward({"answer": 42}, text) == expected


def test_commas_group_thousands_only() -> None:
    assert wp.parse_answer("#### 1,234") == 1234
    assert wp.parse_answer("#### 12,34") == 12  # not a thousands group: the number stops there
    assert wp.reward({"answer": 1234}, "so #### 1,234") == (1.0, True)


@pytest.mark.parametrize(
    "text",
    [
        "#### " + "9" * 100_000,  # a huge number: refused, not converted
        "#### 42" + "x" * 1_000_000,  # the answer lies beyond the tail that is read
        "####" * 200_000,
        "#" * 1_000_000 + "1",
        "#### 4" + ",222" * 50_000,
        "#### ４２",  # full-width digits are not ASCII digits
    ],
)
def test_hostile_replies_are_refused_quickly(text: str) -> None:
    start = time.perf_counter()
    assert wp.reward({"answer": 42}, text)[1] is False
    # Only catches a hang: read through its last MAX_REPLY_CHARS characters, each of these takes
    # under a millisecond (and under 0.1 s read whole); a parse quadratic in the reply's length
    # would take minutes on the longest.
    assert time.perf_counter() - start < 60


def test_control_characters_and_lone_surrogates_around_an_answer_do_not_hide_it() -> None:
    assert wp.reward({"answer": 42}, "\x00\ud800#### 42\ud800\x1b[2J") == (1.0, True)


def test_reward_never_raises_on_non_strings() -> None:
    assert wp.parse_answer(None) is None
    assert wp.parse_answer(42) is None
    assert wp.reward({"answer": 42}, None) == (0.0, False)  # type: ignore[arg-type]


def test_the_answer_at_the_end_of_a_long_reply_is_read() -> None:
    assert wp.reward({"answer": 42}, "blah " * 10_000 + "#### 42") == (1.0, True)
