"""The guards that stop a run that cannot succeed: the failure-rate breaker and the no-signal guard."""

from __future__ import annotations

import logging
from collections import deque

from rllm_async.config import Config
from rllm_async.coordinator import GroupState

log = logging.getLogger(__name__)

_BREAKER_MIN_ROLLOUTS = 32
# Filtered groups in a row, in steps' worth, that make the run warn that it learns nothing.
_NO_SIGNAL_WARNING_STEPS = 3


class FailureRateError(RuntimeError):
    """Too many rollouts failed recently (`rollout.max_failure_rate`); the run stops."""


class InfraFailureRateError(FailureRateError):
    """Too many rollouts' infrastructure failed recently (`rollout.max_infra_failure_rate`): a
    tool, sandbox or environment is broken, not the model; the run stops."""


class NoSignalError(RuntimeError):
    """`algorithm.no_signal_steps` steps' worth of groups in a row were filtered: nothing is learned."""


class _Window:
    """The failures among the last `window` rollouts, by number."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._failed: deque[int] = deque()

    def rate(self, seen: int, failed: bool) -> float | None:
        """Count rollout number `seen`; the failed share of the window, once it holds at least
        min(window, 32) rollouts (None before, or while none failed)."""
        failures = self._failed
        if failed:
            failures.append(seen)
        if not failures:
            return None
        if failures[0] <= seen - self.window:  # the window moves on by one
            failures.popleft()
        n = min(seen, self.window)
        if n < min(self.window, _BREAKER_MIN_ROLLOUTS):
            return None
        return len(failures) / n


class FailureRateBreaker:
    """The circuit breaker over the last `rollout.failure_window` rollouts: raises
    FailureRateError when more than `rollout.max_failure_rate` of them failed, and
    InfraFailureRateError when more than `rollout.max_infra_failure_rate` of them failed for
    their infrastructure (`rllm_async.infra`). The two are counted apart: an infrastructure
    failure is not one of the first kind, so each limit speaks of its own cause."""

    def __init__(self, config: Config) -> None:
        ro = config.rollout
        self.window = ro.failure_window
        self.max_rate = ro.max_failure_rate
        self.max_infra_rate = ro.max_infra_failure_rate
        self._seen = 0  # rollouts observed
        self._errors = _Window(self.window)
        self._infra = _Window(self.window)
        self._last_error = ""
        self._last_infra_error = ""

    def observe(self, failed: bool, last_error: str, infra: bool = False) -> None:
        """Count one rollout's outcome (`infra`: it failed for its infrastructure); `last_error`
        (if any) is named when the breaker trips."""
        if last_error:
            if infra:
                self._last_infra_error = last_error
            else:
                self._last_error = last_error
        self._seen += 1
        n = min(self._seen, self.window)
        rate = self._infra.rate(self._seen, failed and infra)
        if rate is not None and rate > self.max_infra_rate:
            raise InfraFailureRateError(
                f"{rate:.0%} of the last {n} rollouts failed for their infrastructure, not the "
                f"model (rollout.max_infra_failure_rate={self.max_infra_rate}): a tool, sandbox "
                f"or environment the workflow uses is failing; last error: "
                f"{self._last_infra_error}. Fix that service (is it running and reachable, with "
                "room for rollout.max_concurrency rollouts at once?), or raise "
                "rollout.max_infra_failure_rate to train through it"
            )
        rate = self._errors.rate(self._seen, failed and not infra)
        if rate is not None and rate > self.max_rate:
            raise FailureRateError(
                f"{rate:.0%} of the last {n} rollouts failed (rollout.max_failure_rate="
                f"{self.max_rate}); last error: {self._last_error}. Fix the workflow, or raise "
                "rollout.timeout_s / rollout.retries / rollout.max_failure_rate"
            )


class NoSignalGuard:
    """Warns when the groups of a few steps in a row were all filtered, and raises NoSignalError
    when `algorithm.no_signal_steps` steps' worth were: no step can be taken on them."""

    def __init__(self, config: Config) -> None:
        self.limit = config.algorithm.no_signal_steps
        self.per_step = config.train.groups_per_step
        self.filter_unsolved = config.algorithm.filter_unsolved
        self._filtered_in_a_row = 0

    def observe(self, state: GroupState) -> None:
        """Count how a completed group ended."""
        if state is not GroupState.FILTERED:
            self._filtered_in_a_row = 0
            return
        self._filtered_in_a_row += 1
        n, per_step, limit = self._filtered_in_a_row, self.per_step, self.limit
        if limit is not None and n >= limit * per_step:
            raise NoSignalError(
                f"{self._reason()}; stopped at algorithm.no_signal_steps={limit} "
                "steps' worth of them"
            )
        if n == _NO_SIGNAL_WARNING_STEPS * per_step:
            stop = (
                f"the run stops at {limit * per_step} in a row (algorithm.no_signal_steps={limit})"
                if limit is not None
                else "algorithm.no_signal_steps is null, so the run goes on"
            )
            log.warning(f"{self._reason()}; {stop}", extra={"status": "no signal"})

    def _reason(self) -> str:
        """Why the last groups were all filtered, and the knobs that change it."""
        why, flags = "had equal rewards within the group", ["filter_zero_variance"]
        if self.filter_unsolved:
            why += " or no correct rollout"
            flags.append("filter_unsolved")
        return (
            f"the last {self._filtered_in_a_row} groups all {why} and were filtered, so there is "
            "nothing to learn from: the policy always fails (or always succeeds). Warm-start the "
            "policy, make the task easier or the reward denser, or set "
            + " or ".join(f"algorithm.{flag}=false" for flag in flags)
        )
