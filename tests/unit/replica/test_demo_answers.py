"""The packaged demo model on held-out chats (`replica.demo.answercheck` says what each level means): at least 90%
of its greedy answers end by themselves, in the asked language, as an answer of the asked scenario; and it copies
the ask's values (order numbers, dates, names) into nearly the share of its answers it did when it was built.
That share is its known weakness: about one answer in ten misses, mostly a time named in the ask (the failure
message lists them)."""

from __future__ import annotations

from replica.demo.answercheck import answer_prompts, check_answers
from replica.demo.build import ensure_demo_model
from replica.model.loader import load_model
from replica.tokenizer import Tokenizer

NUM_PROMPTS = 200
MIN_SCENARIO_RATE = 0.9
MIN_COMPLETE_RATE = 0.88
"""The packaged v8 build reaches 1.0 and 0.90 on these prompts (1.0 and 0.902 on 400 chats of another seed:
`benchmarks.demo_answers`); the margin below them is for a CPU whose float rounding flips a close greedy choice."""


def test_the_demo_model_answers_held_out_chats() -> None:
    path = ensure_demo_model()
    model = load_model(path)
    tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    prompts = answer_prompts(NUM_PROMPTS)
    results = check_answers(model, tokenizer, prompts)

    def misses(level: str) -> list[str]:
        return [
            f"- [{p.exchange.language} {p.exchange.scenario}] {p.messages[-1]['content']!r}\n"
            f"  -> {text!r}\n  {verdict.reason}"
            for (verdict, text), p in zip(results, prompts, strict=True)
            if not verdict.reaches(level)
        ]

    off_scenario = misses("scenario")
    rate = 1 - len(off_scenario) / NUM_PROMPTS
    assert rate >= MIN_SCENARIO_RATE, f"{rate:.0%} answer the asked scenario; the others:\n" + "\n".join(off_scenario)
    incomplete = misses("complete")
    rate = 1 - len(incomplete) / NUM_PROMPTS
    assert rate >= MIN_COMPLETE_RATE, f"{rate:.0%} of answers complete; the others:\n" + "\n".join(incomplete)
