"""The event core: events run in (time, scheduling order), the clock only moves forward."""

from __future__ import annotations

import pytest

from simulations.events import Simulator


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    sim = Simulator()
    seen: list[tuple[float, str]] = []

    def note(label: str) -> None:
        seen.append((sim.now, label))

    sim.at(2.0, note, "c")
    sim.at(1.0, note, "a")
    sim.at(1.0, note, "b")
    sim.at(0.5, lambda _: sim.after(0.5, note, "after"))  # scheduled later, same time as "a" and "b": runs last
    sim.run()
    assert seen == [(1.0, "a"), (1.0, "b"), (1.0, "after"), (2.0, "c")]
    assert sim.num_events == 5


def test_run_until_leaves_later_events_pending() -> None:
    sim = Simulator()
    seen: list[float] = []
    for t in (1.0, 2.0, 3.0):
        sim.at(t, seen.append, t)
    sim.run(until_s=2.0)
    assert seen == [1.0, 2.0]
    assert sim.now == 2.0
    assert sim.num_pending == 1


def test_cannot_schedule_in_the_past() -> None:
    sim = Simulator()
    sim.at(1.0, lambda _: None)
    sim.run()
    with pytest.raises(ValueError):
        sim.at(0.5, lambda _: None)
