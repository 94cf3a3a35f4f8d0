"""The adaptive k: per sequence from its acceptance, per batch size from measured tokens per second."""

from __future__ import annotations

import pytest

from replica.engine.sampling import SamplingParams
from replica.engine.sequence import Sequence
from replica.engine.speculation import SpeculationPolicy, SpeculationPolicyConfig


def seq(acceptance: float | None, trials: float = 1e6) -> Sequence:
    """A sequence whose own counts say `acceptance` (with so many trials that the prior does not matter)."""
    s = Sequence(0, [1, 2, 3], SamplingParams(), 0.0)
    if acceptance is not None:
        s.draft_accepted, s.draft_trials = acceptance * trials, trials
    return s


@pytest.mark.parametrize(
    ("acceptance", "expected"),
    [(1.0, 8), (0.9, 8), (0.7, 6), (0.5, 3), (0.3, 1), (0.05, 1)],
)
def test_a_sequence_drafts_while_its_next_draft_is_likely_enough(acceptance: float, expected: int) -> None:
    """alpha^k >= 0.1: 0.7^6 = 0.118 but 0.7^7 = 0.082; 0.5^3 = 0.125; never fewer than one draft."""
    policy = SpeculationPolicy(SpeculationPolicyConfig(num_speculative_tokens=8))
    assert policy.num_drafts(seq(acceptance)) == expected
    fixed = SpeculationPolicy(SpeculationPolicyConfig(num_speculative_tokens=8, adaptive=False))
    assert fixed.num_drafts(seq(acceptance)) == 8


def test_acceptance_estimates_follow_verifications() -> None:
    policy = SpeculationPolicy(SpeculationPolicyConfig(num_speculative_tokens=8))
    s = seq(None)
    assert policy.estimate(s) == 0.5  # nothing seen yet: the replica's prior
    for _ in range(20):
        policy.observe_verification(s, num_drafts=8, num_accepted=8)  # every draft kept: alpha -> 1
    assert policy.estimate(s) > 0.99 and policy.num_drafts(s) == 8
    for _ in range(20):
        policy.observe_verification(s, num_drafts=8, num_accepted=0)  # the first draft rejected each time
    assert policy.estimate(s) < 0.3 and policy.num_drafts(s) == 1
    # One bad round after good ones moves k a little, not to the floor.
    steady = seq(None)
    for _ in range(10):
        policy.observe_verification(steady, num_drafts=8, num_accepted=8)
    policy.observe_verification(steady, num_drafts=8, num_accepted=0)
    assert policy.num_drafts(steady) >= 6
    # A round of 4 drafts with 2 accepted is 3 trials: 2 successes and the rejection.
    t = seq(None)
    SpeculationPolicy(SpeculationPolicyConfig(num_speculative_tokens=4)).observe_verification(t, 4, 2)
    assert (t.draft_accepted, t.draft_trials) == (2, 3)


def fraction_speculating(spec_tokens_per_s: float, plain_tokens_per_s: float, steps: int = 400) -> float:
    """Drive the policy with steps whose measured rates are given; -> share of steps that speculated."""
    policy = SpeculationPolicy(SpeculationPolicyConfig(num_speculative_tokens=4, explore_interval=32, explore_steps=3))
    batch = 16
    speculated = 0
    for _ in range(steps):
        mode = policy.should_speculate(batch)
        speculated += mode
        tokens = 3 * batch if mode else batch
        rate = spec_tokens_per_s if mode else plain_tokens_per_s
        policy.observe_step(batch, tokens, tokens / rate, speculative=mode)
    return speculated / steps


def test_a_batch_size_where_speculation_costs_more_than_it_saves_stops_speculating() -> None:
    assert fraction_speculating(spec_tokens_per_s=800, plain_tokens_per_s=1000) < 0.15  # trials only
    assert fraction_speculating(spec_tokens_per_s=1500, plain_tokens_per_s=1000) > 0.85
    # Tries that keep confirming the choice come less and less often: a useless drafter costs ever less.
    assert fraction_speculating(spec_tokens_per_s=300, plain_tokens_per_s=1000, steps=4000) < 0.02
    assert fraction_speculating(spec_tokens_per_s=3000, plain_tokens_per_s=1000, steps=4000) > 0.98


def test_buckets_are_measured_apart() -> None:
    policy = SpeculationPolicy(SpeculationPolicyConfig(num_speculative_tokens=4))
    for _ in range(5):
        policy.observe_step(1, 40, 0.01, speculative=True)  # batch 1: speculation fast
        policy.observe_step(1, 10, 0.01, speculative=False)
        policy.observe_step(32, 320, 0.1, speculative=True)  # batch 32: slow
        policy.observe_step(32, 320, 0.05, speculative=False)
    rates = policy.rates()
    assert rates[policy.bucket(1)][0] > rates[policy.bucket(1)][1]
    assert rates[policy.bucket(32)][0] < rates[policy.bucket(32)][1]
    assert policy.should_speculate(1) and not policy.should_speculate(33)
    assert policy.bucket(16) == policy.bucket(31) != policy.bucket(32)


def test_no_speculation_without_tokens_to_draft() -> None:
    assert not SpeculationPolicy(SpeculationPolicyConfig(num_speculative_tokens=0)).should_speculate(1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculationPolicyConfig(num_speculative_tokens=-1)


def test_the_summary_line_reports_vllms_mean_acceptance_length() -> None:
    from replica.server.metrics import SpeculationSummary

    summary = SpeculationSummary()
    assert summary.line() is None
    summary.add(num_drafts=4, num_accepted=6, accepted_per_position=[4, 2])
    summary.add(num_drafts=4, num_accepted=2, accepted_per_position=[2])
    line = summary.line()
    assert line is not None and "mean acceptance length 2.00 over 8 verifications" in line
    assert line.endswith("acceptance by draft position 0.75 0.25")
    assert summary.line() is None  # counted since the last line only


def test_a_try_measures_the_traffic_of_now_not_of_before() -> None:
    """Traffic the drafter fails on (text past an answer's end), then traffic it guesses well: the first try of
    speculation after the change measures the new traffic alone and switches back, however long the bad stretch
    made the interval between tries."""
    policy = SpeculationPolicy(SpeculationPolicyConfig(num_speculative_tokens=4, explore_interval=32, explore_steps=3))
    batch = 1

    def run(steps: int, spec_tokens_per_s: float, plain_tokens_per_s: float) -> list[bool]:
        modes = []
        for _ in range(steps):
            mode = policy.should_speculate(batch)
            modes.append(mode)
            tokens = 3 * batch if mode else batch
            rate = spec_tokens_per_s if mode else plain_tokens_per_s
            policy.observe_step(batch, tokens, tokens / rate, speculative=mode)
        return modes

    bad = run(4000, spec_tokens_per_s=300, plain_tokens_per_s=1000)
    assert sum(bad[-1000:]) < 10
    good = run(2000, spec_tokens_per_s=3000, plain_tokens_per_s=1000)
    first_try = good.index(True)
    assert first_try <= policy.config.max_explore_interval
    after = good[first_try:]
    assert sum(after) / len(after) > 0.95, "speculation should come back once a try has measured the new traffic"
