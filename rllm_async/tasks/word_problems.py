"""Word problems: short arithmetic stories with integer answers, for RL on a small real model.

What. A seeded generator of one- and two-step problems written from templates by this module
(shopping totals, change from a bill, sharing equally, ages, items left, buying more then giving
some away), each with an integer `answer`, and a reward that reads the reply's final answer.

Why. The countdown task suits a character model built from scratch; a pretrained chat model such as
SmolLM2-135M-Instruct needs natural-language questions, and it needs them offline: every problem is
written here, so nothing is downloaded. The numbers' range (`max_number`) and the kinds of problem
(`kinds`) set the difficulty, so that an untrained model solves some problems but not most of them,
and GRPO groups have reward variance from the first step.

Format. SmolLM2-135M-Instruct does not take up a new answer format from an instruction alone, but
it does from one worked example in the chat, so each prompt is a list of chat messages: a worked
example (a question, then an answer that shows the arithmetic in one line and ends with
`#### <number>`, GSM8K's convention), then the problem. By default the example is a problem of
the same kind with other numbers (`example="kind"`): with one fixed example the model mostly
picked the wrong operation (about 0.15 greedy held-out accuracy, under 0.07 sampled at
temperature 0.7), with a same-kind example it is left with the arithmetic, which it gets wrong
often enough (about 0.3 greedy) for RL to improve. `reward` gives 1.0 when the number after the
last `####` equals the answer, `FORMAT_REWARD` for a wrong number in the format, 0.0 otherwise;
it parses the text with a regular expression over a bounded tail and never evaluates it.

Held-out problems. A problem's `key` (its kind and numbers, not the names or objects) falls in the
held-out bucket or not by a fixed hash: `split="test"` draws only held-out problems, `split="train"`
never draws one, so an eval set and a training set are disjoint whatever their seeds.

Use: `data.train.generator: rllm_async.tasks.word_problems:generator` with
`workflow.args.reward_fn: rllm_async.tasks.word_problems:reward` (examples/smollm2/).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable
from typing import Any

FORMAT_REWARD = 0.1  # the answer in the `#### <number>` format, but wrong
MAX_REPLY_CHARS = 4000  # only a reply's last this many characters are read
MAX_ANSWER_DIGITS = 12
HELDOUT_BUCKETS = 8  # one key in 8 is held out
SPLITS = ("train", "test", "all")
EXAMPLES = ("kind", "other", "mixed", "fixed")

NAMES = (
    "Ava", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jon", "Kira", "Leo",
    "Maya", "Nico", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yuki",
)  # fmt: skip
OBJECTS = (
    "apples", "marbles", "stickers", "pencils", "cookies", "books", "cards", "shells", "stamps",
    "buttons", "coins", "eggs", "flowers", "balloons", "crayons", "toy cars",
)  # fmt: skip
GOODS = (
    "notebook", "sandwich", "toy", "ticket", "pen", "cupcake", "comic", "bracelet", "kite", "mug",
    "candle", "puzzle",
)  # fmt: skip

# The worked example of `example="fixed"`: a two-step problem unlike any template's wording,
# answered in the format the reward reads.
EXAMPLE_QUESTION = (
    "A baker makes 3 trays of muffins with 6 muffins on each tray. He sells 5 muffins. "
    "How many muffins does he have left?"
)
EXAMPLE_ANSWER = "He makes 3 * 6 = 18 muffins. After selling 5, he has 18 - 5 = 13 left.\n#### 13"

# question, answer, numbers (the key's payload), worked solution (the reasoning before `####`)
Problem = tuple[str, int, tuple[int, ...], str]
Template = Callable[[random.Random, int], Problem]


def _two_names(rng: random.Random) -> tuple[str, str]:
    first, second = rng.sample(NAMES, 2)
    return first, second


def _total(rng: random.Random, m: int) -> Problem:
    name, a, b = rng.choice(NAMES), rng.randint(2, m), rng.randint(2, m)
    g1, g2 = rng.sample(GOODS, 2)
    question = (
        f"{name} buys a {g1} for {a} dollars and a {g2} for {b} dollars. "
        f"How many dollars does {name} spend in total?"
    )
    return question, a + b, (a, b), f"{a} + {b} = {a + b}."


def _price(rng: random.Random, m: int) -> Problem:
    name, count, price = rng.choice(NAMES), rng.randint(2, 9), rng.randint(2, m)
    good = rng.choice(GOODS)
    question = (
        f"{name} buys {count} {good}s that cost {price} dollars each. "
        f"How many dollars does {name} pay?"
    )
    return question, count * price, (count, price), f"{count} * {price} = {count * price}."


def _share(rng: random.Random, m: int) -> Problem:
    name, each, friends = rng.choice(NAMES), rng.randint(2, m), rng.randint(2, 9)
    thing = rng.choice(OBJECTS)
    question = (
        f"{name} has {each * friends} {thing} and shares them equally among {friends} friends. "
        f"How many {thing} does each friend get?"
    )
    return question, each, (each * friends, friends), f"{each * friends} / {friends} = {each}."


def _left(rng: random.Random, m: int) -> Problem:
    name, total = rng.choice(NAMES), rng.randint(5, 2 * m)
    gone = rng.randint(1, total - 1)
    thing = rng.choice(OBJECTS)
    question = (
        f"{name} had {total} {thing} and gave away {gone} of them. "
        f"How many {thing} does {name} have left?"
    )
    return question, total - gone, (total, gone), f"{total} - {gone} = {total - gone}."


def _age(rng: random.Random, m: int) -> Problem:
    (a, b), age, gap = _two_names(rng), rng.randint(3, m), rng.randint(2, m)
    question = f"{a} is {age} years old. {b} is {gap} years older than {a}. How old is {b}?"
    return question, age + gap, (age, gap), f"{age} + {gap} = {age + gap}."


def _age_ago(rng: random.Random, m: int) -> Problem:
    name, age = rng.choice(NAMES), rng.randint(6, 2 * m)
    ago = rng.randint(1, age - 1)
    question = f"{name} is {age} years old now. How old was {name} {ago} years ago?"
    return question, age - ago, (age, ago), f"{age} - {ago} = {age - ago}."


def _more_then_give(rng: random.Random, m: int) -> Problem:
    (a, b), have, more = _two_names(rng), rng.randint(2, m), rng.randint(2, m)
    give = rng.randint(1, have + more - 1)
    thing = rng.choice(OBJECTS)
    question = (
        f"{a} has {have} {thing}. {a} gets {more} more, then gives {give} to {b}. "
        f"How many {thing} does {a} have now?"
    )
    total = have + more
    solution = f"{have} + {more} = {total}. {total} - {give} = {total - give}."
    return question, total - give, (have, more, give), solution


def _change(rng: random.Random, m: int) -> Problem:
    name, count, price = rng.choice(NAMES), rng.randint(2, 9), rng.randint(2, m)
    cost = count * price
    bill = next((b for b in (10, 20, 50, 100) if b > cost), 100 * (cost // 100 + 1))
    good = rng.choice(GOODS)
    question = (
        f"{name} buys {count} {good}s at {price} dollars each and pays with a {bill} dollar bill. "
        f"How many dollars of change does {name} get?"
    )
    solution = f"{count} * {price} = {cost}. {bill} - {cost} = {bill - cost}."
    return question, bill - cost, (count, price, bill), solution


TEMPLATES: dict[str, Template] = {
    "total": _total,
    "price": _price,
    "share": _share,
    "left": _left,
    "age": _age,
    "age_ago": _age_ago,
    "more_then_give": _more_then_give,
    "change": _change,
}


def messages_for(
    question: str, example: tuple[str, str] = (EXAMPLE_QUESTION, EXAMPLE_ANSWER)
) -> list[dict[str, str]]:
    """The chat a problem is asked in: the worked example (a question and its answer), then the
    question."""
    return [
        {"role": "user", "content": example[0]},
        {"role": "assistant", "content": example[1]},
        {"role": "user", "content": question},
    ]


def _key(kind: str, numbers: tuple[int, ...]) -> str:
    return f"{kind}:{','.join(map(str, numbers))}"


def _worked_example(rng: random.Random, kind: str, max_number: int, avoid: str) -> tuple[str, str]:
    """A problem of `kind` and its answer in the format: never a held-out key, nor `avoid`."""
    for _ in range(10_000):
        question, answer, numbers, solution = TEMPLATES[kind](rng, max_number)
        key = _key(kind, numbers)
        if key != avoid and not heldout(key):
            return question, f"{solution}\n#### {answer}"
    raise ValueError(f"word_problems: no worked example of {kind!r} at max_number={max_number}")


def heldout(key: str) -> bool:
    """Whether a problem key is in the held-out bucket (a fixed hash, not Python's salted one)."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") % HELDOUT_BUCKETS == 0


def generator(
    n: int = 1000,
    seed: int = 0,
    max_number: int = 20,
    kinds: list[str] | None = None,
    split: str = "train",
    unique: bool = False,
    example: str = "kind",
) -> list[dict[str, Any]]:
    """`n` problems (id, kind, key, question, prompt, answer), the same for the same arguments.

    `max_number` bounds the quantities (sums of two such numbers, and products of a count up to 9
    and a price up to `max_number`); `kinds` picks templates (default: all of `TEMPLATES`),
    taken in turn (equal shares); `split` is `train` (never a held-out key), `test` (only
    held-out keys) or `all`; `unique` draws each key at most once (for an eval set).

    `example` is the worked example each prompt opens with: `kind`, a solved problem of the same
    kind with other numbers (the reply's form is shown, the arithmetic is left); `other`, one of
    another kind (the form and operation are left to the model); `mixed`, either of them, half
    and half; `fixed`, `EXAMPLE_QUESTION`. Worked examples never use a held-out key."""
    if split not in SPLITS:
        raise ValueError(f"word_problems: split must be one of {SPLITS}, not {split!r}")
    if example not in EXAMPLES:
        raise ValueError(f"word_problems: example must be one of {EXAMPLES}, not {example!r}")
    if max_number < 4:
        raise ValueError("word_problems: max_number must be at least 4")
    names = list(kinds) if kinds is not None else list(TEMPLATES)
    unknown = [k for k in names if k not in TEMPLATES]
    if unknown or not names:
        raise ValueError(f"word_problems: unknown kinds {unknown}; known: {list(TEMPLATES)}")
    rng = random.Random(f"word-problems-{seed}")
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 10_000:
            raise ValueError(
                f"word_problems: could not draw {n} problems (split={split!r}, unique={unique}, "
                f"max_number={max_number}); raise max_number or ask for fewer"
            )
        kind = names[len(out) % len(names)]
        question, answer, numbers, _ = TEMPLATES[kind](rng, max_number)
        key = _key(kind, numbers)
        if (split == "train" and heldout(key)) or (split == "test" and not heldout(key)):
            continue
        if unique:
            if key in seen:
                continue
            seen.add(key)
        shown = (EXAMPLE_QUESTION, EXAMPLE_ANSWER)
        same = example == "kind" or (example == "mixed" and rng.random() < 0.5)
        if same:
            shown = _worked_example(rng, kind, max_number, key)
        elif example in ("other", "mixed"):
            other = rng.choice([k for k in TEMPLATES if k != kind])
            shown = _worked_example(rng, other, max_number, key)
        out.append(
            {
                "id": f"wp-{split}-{seed}-{len(out)}",
                "kind": kind,
                "key": key,
                "question": question,
                "prompt": messages_for(question, shown),
                "answer": answer,
            }
        )
    return out


# `#### 1,234`, `#### $12`, `#### 12.00`: the number right after the marker, on the same line.
_ANSWER = re.compile(r"####[ \t]*\$?[ \t]*(-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?)")


def parse_answer(text: object) -> int | None:
    """The integer after the reply's last `####`, or None (no marker, no number, not an integer,
    too many digits). Reads at most the last MAX_REPLY_CHARS characters; never raises."""
    if not isinstance(text, str):
        return None
    matches = _ANSWER.findall(text[-MAX_REPLY_CHARS:])
    if not matches:
        return None
    raw = matches[-1].replace(",", "")
    whole, _, frac = raw.partition(".")
    if frac.strip("0") or len(whole.lstrip("-")) > MAX_ANSWER_DIGITS:
        return None
    return int(whole)


def reward(task: dict[str, Any], text: str) -> tuple[float, bool]:
    """(1.0, True) when the final answer equals `task["answer"]`; (FORMAT_REWARD, False) for
    another number after `####`; (0.0, False) otherwise. Never raises on the reply."""
    value = parse_answer(text)
    if value is None:
        return 0.0, False
    if value == int(task["answer"]):
        return 1.0, True
    return FORMAT_REWARD, False
