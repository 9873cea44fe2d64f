"""Countdown: combine every given number exactly once with + - * (and parentheses) to hit a target.

Small numbers and short prompts keep it learnable by a tiny character model. Use it as
`data.train.generator: rllm_async.tasks.countdown:generator` with
`workflow.args.reward_fn: rllm_async.tasks.countdown:reward`.

The reward parses the reply with its own tiny parser; model output is never executed.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

FORMAT_REWARD = 0.1  # a valid expression over the right numbers with the wrong value
MAX_ANSWER_CHARS = 64
MAX_DEPTH = 16  # parenthesis nesting; also bounds the parser's recursion on hostile input
OPS = "+-*"


def prompt_for(numbers: list[int], target: int) -> str:
    """The question a task asks."""
    return f"Use {' '.join(map(str, numbers))} and + - * to make {target}."


def generator(
    n: int = 1000,
    seed: int = 0,
    min_numbers: int = 3,
    max_numbers: int = 4,
    max_number: int = 9,
    max_target: int = 99,
) -> list[dict[str, Any]]:
    """`n` solvable problems (id, numbers, target, prompt), the same for the same arguments."""
    return list(
        itertools.islice(_problems(seed, min_numbers, max_numbers, max_number, max_target), n)
    )


def _problems(
    seed: int, min_numbers: int, max_numbers: int, max_number: int = 9, max_target: int = 99
) -> Iterator[dict[str, Any]]:
    """The endless stream that `generator` takes its first `n` problems from."""
    if not 2 <= min_numbers <= max_numbers:
        raise ValueError("countdown needs 2 <= min_numbers <= max_numbers")
    rng = random.Random(seed)
    for index in itertools.count():
        while True:
            count = rng.randint(min_numbers, max_numbers)
            numbers = [rng.randint(1, max_number) for _ in range(count)]
            target = _evaluate(_random_tree(numbers, rng))
            if 0 < target <= max_target and target not in numbers:
                break
        yield {
            "id": f"countdown-{seed}-{index}",
            "numbers": numbers,
            "target": target,
            "prompt": prompt_for(numbers, target),
        }


def reward(task: dict[str, Any], text: str) -> tuple[float, bool]:
    """(1.0, True) for a correct expression; FORMAT_REWARD for a valid one with the wrong value;
    0.0 for anything else (wrong numbers, malformed or hostile text). Never raises."""
    try:
        tree = parse(text)
    except ValueError:
        return 0.0, False
    if Counter(_leaves(tree)) != Counter(int(x) for x in task["numbers"]):
        return 0.0, False
    if _evaluate(tree) == int(task["target"]):
        return 1.0, True
    return FORMAT_REWARD, False


# An expression tree is an int (a number) or a tuple (op, left, right).
Tree = int | tuple[str, "Tree", "Tree"]


def parse(text: object) -> Tree:
    """Parse `expr := term (('+'|'-') term)*, term := factor ('*' factor)*,
    factor := number | '(' expr ')'`; raise ValueError on anything else."""
    if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
        raise ValueError("not a short string")
    parser = _Parser(_tokens(text))
    tree = parser.expr(0)
    if parser.peek() is not None:
        raise ValueError(f"unexpected {parser.peek()!r}")
    return tree


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    for ch in text.strip():
        if ch.isdigit() and ch.isascii():
            if out and out[-1].isdigit():
                out[-1] += ch
            else:
                out.append(ch)
        elif ch in OPS or ch in "()":
            out.append(ch)
        elif not ch.isspace():
            raise ValueError(f"unexpected character {ch!r}")
    return out


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ValueError("unexpected end")
        self.pos += 1
        return token

    def expr(self, depth: int) -> Tree:
        tree = self.term(depth)
        while self.peek() in ("+", "-"):
            tree = (self.take(), tree, self.term(depth))
        return tree

    def term(self, depth: int) -> Tree:
        tree = self.factor(depth)
        while self.peek() == "*":
            tree = (self.take(), tree, self.factor(depth))
        return tree

    def factor(self, depth: int) -> Tree:
        token = self.take()
        if token.isdigit():
            return int(token)
        if token == "(" and depth < MAX_DEPTH:
            tree = self.expr(depth + 1)
            if self.take() != ")":
                raise ValueError("missing ')'")
            return tree
        raise ValueError(f"unexpected {token!r}")


def _evaluate(tree: Tree) -> int:
    if isinstance(tree, int):
        return tree
    op, left, right = tree
    a, b = _evaluate(left), _evaluate(right)
    return a + b if op == "+" else a - b if op == "-" else a * b


def _leaves(tree: Tree) -> Iterator[int]:
    if isinstance(tree, int):
        yield tree
    else:
        yield from _leaves(tree[1])
        yield from _leaves(tree[2])


def _random_tree(numbers: list[int], rng: random.Random) -> Tree:
    trees: list[Tree] = list(numbers)
    rng.shuffle(trees)
    while len(trees) > 1:
        i = rng.randrange(len(trees) - 1)
        trees[i : i + 2] = [(rng.choice(OPS), trees[i], trees[i + 1])]
    return trees[0]


def solve(numbers: list[int], target: int) -> str | None:
    """An expression using every number once that equals `target` (the first found), or None."""
    for tree in _all_trees(tuple(numbers)):
        if _evaluate(tree) == target:
            return render(tree)
    return None


def _all_trees(numbers: tuple[int, ...]) -> Iterator[Tree]:
    """Every expression tree over all of `numbers` (each once), left-leaning shapes first."""
    if len(numbers) == 1:
        yield numbers[0]
        return
    seen: set[tuple[int, ...]] = set()
    for perm in itertools.permutations(numbers):
        if perm in seen:
            continue
        seen.add(perm)
        for split in range(len(perm) - 1, 0, -1):
            for left in _all_trees(perm[:split]):
                for right in _all_trees(perm[split:]):
                    for op in OPS:
                        yield (op, left, right)


def render(tree: Tree) -> str:
    """The expression as text, with only the parentheses it needs."""
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    prec = {"+": 1, "-": 1, "*": 2}
    lhs, rhs = render(left), render(right)
    if isinstance(left, tuple) and prec[left[0]] < prec[op]:
        lhs = f"({lhs})"
    # The right operand also needs them at equal precedence unless the op is associative.
    if isinstance(right, tuple) and (
        prec[right[0]] < prec[op] or (prec[right[0]] == prec[op] and op == "-")
    ):
        rhs = f"({rhs})"
    return f"{lhs}{op}{rhs}"


def warm_start_examples(
    n: int = 2000,
    seed: int = 1,
    solved_share: float = 1.0,
    balance_operations: bool = False,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Transcripts of `n` fresh problems (`backend.warm_start.examples`); use a seed that the
    train and eval data do not. A `solved_share` of them answer with the solver's expression, the
    rest with a random well-formed expression over the same numbers (usually wrong): the model
    learns the answer's form and keeps every operator and order likely, so RL explores them all.

    `balance_operations` picks the problems so that each count of numbers is an equal share and,
    by the solver's answer, two-number problems are sums, differences and products in equal
    shares and larger ones use '-' in half. Left to the generator, 18% of two-number problems are
    differences (one that is not positive, or equals a number, is no problem) and 37% of
    three-number answers use '-'; a warm start that seldom writes '-' leaves RL to drive it out
    altogether (docs/benchmarks.md).
    """
    rng = random.Random(f"warm-{seed}")
    tasks = _balanced(n, seed, **kwargs) if balance_operations else generator(n, seed, **kwargs)
    examples = []
    for task in tasks:
        numbers = list(task["numbers"])
        if rng.random() < solved_share:
            answer = solve(numbers, int(task["target"]))
            assert answer is not None, "the generator makes only solvable problems"
        else:
            answer = render(_random_tree(numbers, rng))
        messages = [
            {"role": "user", "content": task["prompt"]},
            {"role": "assistant", "content": answer},
        ]
        examples.append({"id": task["id"], "solution": answer, "messages": messages})
    return examples


def _balanced(
    n: int, seed: int, min_numbers: int = 3, max_numbers: int = 4, **kwargs: Any
) -> list[dict[str, Any]]:
    """`n` problems in generator order, taken while their kind (number count, and the solver's
    operation for two numbers or whether it uses '-' for more) is short of its equal share."""
    counts = range(min_numbers, max_numbers + 1)
    quota = {}
    for count, share in zip(counts, _split(n, len(counts)), strict=True):
        kinds = OPS if count == 2 else ("-", "no -")
        quota.update({(count, k): q for k, q in zip(kinds, _split(share, len(kinds)), strict=True)})
    # Differences are about a tenth of all problems, and a sixth of `n` is wanted: 8n is plenty.
    chosen = []
    for task in itertools.islice(_problems(seed, min_numbers, max_numbers, **kwargs), 8 * n):
        answer = solve(task["numbers"], int(task["target"]))
        assert answer is not None, "the generator makes only solvable problems"
        if len(task["numbers"]) == 2:
            kind = next(op for op in OPS if op in answer)
        else:
            kind = "-" if "-" in answer else "no -"
        key = (len(task["numbers"]), kind)
        if quota[key] > 0:
            quota[key] -= 1
            chosen.append(task)
            if len(chosen) == n:
                return chosen
    short = ", ".join(f"{q} of ({c} numbers, {k})" for (c, k), q in quota.items() if q > 0)
    raise ValueError(
        f"countdown: could not balance {n} warm-start problems by operation (short of {short}); "
        "allow larger numbers (max_number) or set balance_operations: false"
    )


def _split(total: int, parts: int) -> list[int]:
    """`total` in `parts` shares as equal as integers allow."""
    return [total // parts + (i < total % parts) for i in range(parts)]
