"""Property tests: group conservation after every event and the hard staleness bound, under
random heavy-tailed latencies and random pipeline depths d <= K."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rllm_async.coordinator import Counts
from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run
from tests.fakes import FakeBackend, ScriptedWorkflow, make_config, tasks


@st.composite
def schedules(draw: st.DrawFn) -> dict:
    d = draw(st.integers(0, 3))
    return {
        "d": d,
        "k": d + draw(st.integers(0, 3)),
        "gps": draw(st.integers(1, 4)),
        "group_size": draw(st.integers(1, 4)),
        "alpha": draw(st.floats(1.05, 3.0)),  # Pareto tail index: small = very heavy tail
        "scale": draw(st.floats(0.01, 2.0)),
        "train_s": draw(st.floats(0.0, 3.0)),
        "policy": draw(st.sampled_from(["requeue", "drop"])),
        "weight_update": draw(st.sampled_from(["pin", "latest"])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(s=schedules())
def test_conservation_and_hard_bound(tmp_path, s: dict) -> None:
    rng = random.Random(s["seed"])
    backend = FakeBackend(
        latency=lambda: rng.paretovariate(s["alpha"]) * s["scale"], train_s=s["train_s"]
    )
    workflow = ScriptedWorkflow(reward=lambda task, i, a: float(rng.random() < 0.5))
    cfg = make_config(
        tmp_path,
        train={"total_steps": 6, "groups_per_step": s["gps"], "micro_batch_groups": 1},
        rollout={"group_size": s["group_size"], "min_group_size": 1, "timeout_s": 1e6},
        coordinator={
            "pipeline_depth": s["d"],
            "max_staleness": s["k"],
            "stale_policy": s["policy"],
            "weight_update": s["weight_update"],
        },
        algorithm={"filter_zero_variance": False},
    )
    trainer = UnifiedTrainer(cfg, backend=backend, workflow=workflow, train_tasks=tasks(50))
    events = []

    def check(name: str, c: Counts) -> None:
        total = c.in_flight + c.buffered + c.consumed + c.filtered + c.failed
        assert c.dispatched == total + c.dropped_stale + c.cancelled, (name, c)
        coord = trainer.coordinator
        limit = (coord.version + s["d"] + 1) * s["gps"]
        assert c.consumed + c.in_flight + c.buffered <= limit, (name, c, coord.version)
        events.append(name)

    trainer.coordinator.on_event = check
    records = run(trainer.fit(), virtual=True)

    assert len(records) == 6
    assert len(backend.trained) == 6
    assert all(len(step) == s["gps"] for step in backend.trained)
    assert backend.staleness and max(backend.staleness) <= s["k"]
    assert max(r["staleness/max"] for r in records) <= s["k"]
    assert "dispatched" in events and "consumed" in events
    assert backend.policy().live == {}, "every pinned snapshot is released"
