"""Property tests: group conservation after every event and the hard staleness bound, under
random heavy-tailed latencies and random pipeline depths d <= K."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rllm_async.coordinator import Counts
from rllm_async.vclock import run
from tests import heavy_tailed


@st.composite
def schedules(draw: st.DrawFn) -> dict:
    return {
        **draw(heavy_tailed.schedules()),
        "policy": draw(st.sampled_from(["requeue", "drop"])),
        "weight_update": draw(st.sampled_from(["pin", "latest"])),
    }


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(s=schedules())
def test_conservation_and_hard_bound(tmp_path, s: dict) -> None:
    coordinator = {"stale_policy": s["policy"], "weight_update": s["weight_update"]}
    trainer, backend = heavy_tailed.trainer(tmp_path, s, {}, coordinator)
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
