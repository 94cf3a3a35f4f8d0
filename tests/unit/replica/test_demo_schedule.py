"""The demo model's learning-rate schedules: in pretraining steps decide it, the clock only when a run falls behind its
budget; the answer steps that follow warm up again and fall to a tenth of their own peak."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from replica.demo.build import (
    ANSWER_WARMUP_STEPS,
    WARMUP_STEPS,
    DemoRecipe,
    _train,
    _Windows,
    answer_learning_rate,
    scheduled_learning_rate,
)

RECIPE = DemoRecipe()


@pytest.mark.parametrize("step", [0, 1, WARMUP_STEPS, 200, RECIPE.max_steps - 1])
def test_a_run_that_keeps_up_with_its_steps_never_reads_the_clock(step: int) -> None:
    # From the start of training to just before this step would be behind the budget (max_seconds / max_steps per
    # step). The first step runs a few milliseconds into training: the old schedule read that into its rate.
    budget_s = (step + 1) * RECIPE.max_seconds / RECIPE.max_steps
    elapsed = (0.0, 1e-6, 0.003, 0.5 * budget_s, 0.999 * budget_s)
    assert len({scheduled_learning_rate(RECIPE, step, e) for e in elapsed}) == 1


def test_the_rate_rises_through_the_warm_up_then_falls_to_a_tenth() -> None:
    rates = [scheduled_learning_rate(RECIPE, step, 0.0) for step in range(RECIPE.max_steps + 1)]
    peak = rates.index(max(rates))
    assert peak == WARMUP_STEPS - 1
    assert rates[0] < RECIPE.learning_rate / 10
    assert all(a < b for a, b in pairwise(rates[: peak + 1]))
    assert all(a > b for a, b in pairwise(rates[peak:]))
    assert rates[-1] == pytest.approx(0.1 * RECIPE.learning_rate)


def test_a_run_behind_its_budget_follows_the_clock_down() -> None:
    step = 100
    on_time = scheduled_learning_rate(RECIPE, step, 0.0)
    late = scheduled_learning_rate(RECIPE, step, 0.8 * RECIPE.max_seconds)
    out_of_time = scheduled_learning_rate(RECIPE, step, RECIPE.max_seconds)
    assert out_of_time == pytest.approx(0.1 * RECIPE.learning_rate)
    assert out_of_time < late < on_time


def test_the_answer_steps_warm_up_to_their_own_peak_then_fall_to_a_tenth() -> None:
    rates = [answer_learning_rate(RECIPE, step) for step in range(RECIPE.answer_steps + 1)]
    peak = rates.index(max(rates))
    assert peak == ANSWER_WARMUP_STEPS - 1
    assert max(rates) < RECIPE.answer_learning_rate
    assert all(a < b for a, b in pairwise(rates[: peak + 1]))
    assert all(a > b for a, b in pairwise(rates[peak:]))
    assert rates[-1] == pytest.approx(0.1 * RECIPE.answer_learning_rate)


def test_a_phase_that_runs_out_of_time_says_so() -> None:
    windows = _Windows(torch.zeros(64, dtype=torch.long), torch.zeros(1, dtype=torch.long), None, RECIPE, 8, None)
    said: list[str] = []
    steps, _ = _train(
        torch.nn.Linear(2, 2), windows, 5, lambda step: 1e-3, label="answer step", max_seconds=0.0, progress=said.append
    )
    assert steps == 0
    assert said == ["answer steps: stopped at 0 of 5, out of time (0 s): not the model a faster machine builds"]
