"""Final-answer rewards for math problems (GSM8K, MATH) checked with `math-verify`.

The reply's answer is its last `\\boxed{...}`, else what follows its last `####` (GSM8K's
marker); the task's `answer` field may be either or a bare value. Both are parsed from LaTeX into
sympy objects by math-verify's grammar (never `eval`, never sympy's `parse_expr`) and compared in
a worker process that is killed after `TIMEOUT_S`, so a hostile answer (`2^{2^{2^{99}}}`) costs
a zero reward and a few seconds, never a hung run. `pip install 'rllm-async[math]'`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import concurrent.futures.process
import importlib.util
import logging
import multiprocessing
import re
import threading
from typing import Any

TIMEOUT_S = 5.0  # per comparison, parsing included
# A new worker's start (a spawned interpreter importing math-verify and sympy: seconds, more on a
# loaded machine) is not a comparison's: it gets its own bound, which only catches a hang.
STARTUP_TIMEOUT_S = 300.0
MAX_ANSWER_CHARS = 1000  # a longer "answer" is refused unparsed

_GSM8K = re.compile(r"####\s*([^\n]*)")
_pool: concurrent.futures.ProcessPoolExecutor | None = None
_lock = threading.Lock()


def math_reward(task: dict[str, Any], text: str) -> tuple[float, bool]:
    """1.0 and correct when the reply's final answer equals the task's `answer`, else 0.0."""
    if "answer" not in task:
        raise KeyError(
            f"task {task.get('id')!r} has no 'answer' field, which math_reward compares against; "
            "map the dataset's answer column onto it with data.<split>.columns"
        )
    gold = final_answer(str(task["answer"])) or str(task["answer"]).strip()
    given = final_answer(text)
    if given is None or not gold or len(given) > MAX_ANSWER_CHARS:
        return 0.0, False
    correct = _check(gold, given)
    return (1.0 if correct else 0.0), correct


def final_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text` (braces matched), else what follows its
    last `####` (thousands separators and `$` removed), else None."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j].strip()
        return None  # unbalanced: malformed
    found = _GSM8K.findall(text)
    if found:
        answer = re.sub(r"(?<=\d),(?=\d{3})", "", found[-1]).replace("$", "").strip()
        return answer or None
    return None


def _check(gold: str, given: str) -> bool:
    """`verify(gold, given)` in the worker process, False after `TIMEOUT_S`."""
    global _pool
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError("math_reward needs math-verify: pip install 'rllm-async[math]'")
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn")
            )
            _pool.submit(_start).result(timeout=STARTUP_TIMEOUT_S)
        pool = _pool
    try:
        return pool.submit(_verify, gold, given).result(timeout=TIMEOUT_S)
    except (concurrent.futures.TimeoutError, concurrent.futures.process.BrokenProcessPool):
        with _lock:
            if _pool is pool:
                _pool = None
        _kill(pool)
        return False


def _kill(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Stop a pool whose worker may be stuck in a computation: kill its processes."""
    for proc in list(getattr(pool, "_processes", {}).values()):
        proc.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def _start() -> None:
    """In a new worker: import what `_verify` needs, before any comparison's clock starts."""
    import math_verify  # noqa: F401


def _verify(gold: str, given: str) -> bool:
    """In the worker: parse both as LaTeX (math-verify's grammar only) and compare; an answer that
    does not parse, or makes the parser or sympy raise, is wrong."""
    from math_verify import LatexExtractionConfig, parse, verify

    # The worker's own (signal-based) timeouts are off, and their warning with them: the parent's
    # kill bounds the time.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    config = [LatexExtractionConfig(boxed_match_priority=0)]
    try:
        target = parse(f"\\boxed{{{gold}}}", extraction_config=config, parsing_timeout=None)
        pred = parse(f"\\boxed{{{given}}}", extraction_config=config, parsing_timeout=None)
        return bool(target and pred and verify(target, pred, timeout_seconds=None))
    except Exception:  # RecursionError on deep nesting, sympy's own errors
        return False


@atexit.register
def _stop() -> None:
    if _pool is not None:
        _kill(_pool)
