"""The packaged demo model on held-out chats (`replica.demo.answercheck` says what each level means): at least 90%
of its greedy answers end by themselves, in the asked language, as an answer of the asked scenario; and it copies
the ask's values (order numbers, dates, names) into at least the share of its answers it did when it was built.
That share is its known weakness: about one answer in six misses, mostly a company or a product named in the ask
(the failure message lists them). And `make demo`'s Japanese chat gets an answer of its scenario with its order
number."""

from __future__ import annotations

from replica.demo.answercheck import answer_prompts, check_answers
from replica.demo.build import ensure_demo_model
from replica.model.loader import load_model
from replica.tokenizer import Tokenizer

NUM_PROMPTS = 200
MIN_SCENARIO_RATE = 0.9
MIN_COMPLETE_RATE = 0.8
"""The packaged v6 build reaches 1.0 and 0.825 on these prompts."""


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


def test_the_demo_japanese_chat_gets_an_order_status_answer_with_its_order_number() -> None:
    from replica.demo.requests import japanese_chat_request
    from replica.engine.engine import EngineConfig, LLMEngine
    from replica.engine.sampling import SamplingParams

    path = ensure_demo_model()
    model = load_model(path)
    tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    body = japanese_chat_request("shoal-demo")
    engine = LLMEngine(model, EngineConfig(num_blocks=64), eos_token_ids=tokenizer.eos_token_ids)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(body["messages"]))
    engine.add_request(prompt, SamplingParams(max_tokens=body["max_tokens"], temperature=0.0))
    ids: list[int] = []
    while engine.has_work:
        for out in engine.step().outputs:
            ids.extend(out.new_token_ids)
    text = tokenizer.decode(ids)
    assert text.startswith("承知いたしました。ご注文ORD-30981は"), text
