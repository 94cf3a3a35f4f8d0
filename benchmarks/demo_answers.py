"""How well a demo checkpoint answers held-out chats, on more than the test's prompts.

`tests/unit/replica/test_demo_answers.py` holds the packaged model to its figures on 200 prompts of
`answercheck.HELDOUT_SEED`; a recipe tuned against those alone could fit them. This prints, for each seed, the share
of greedy answers that reach each of `answercheck.LEVELS`, and which slots the answers that stop at "scenario" got
wrong (none of the seeds is a training seed).

    .venv/bin/python -m benchmarks.demo_answers                          # the packaged model, 200 + 400 prompts
    .venv/bin/python -m benchmarks.demo_answers --model PATH --seeds 31415:200,27182:400,1618:400
"""

from __future__ import annotations

import argparse
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from benchmarks import command_line, machine_description
from replica.demo.answercheck import HELDOUT_SEED, LEVELS, answer_prompts, check_answers
from replica.demo.build import ensure_demo_model
from replica.model.loader import load_model
from replica.tokenizer import Tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="checkpoint folder, or `demo` (the packaged model)")
    parser.add_argument("--seeds", default=f"{HELDOUT_SEED}:200,27182:400", help="SEED:PROMPTS pairs, comma-separated")
    args = parser.parse_args()
    path = ensure_demo_model() if args.model == "demo" else Path(args.model)
    model = load_model(path)
    tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    print(command_line())
    print(f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; machine: {machine_description()}")
    print(f"model: {args.model}; greedy, max_tokens 192")
    print(f"{'seed':>6} {'prompts':>7} " + " ".join(f"{level:>9}" for level in LEVELS) + "  wrong slots (scenario)")
    for pair in args.seeds.split(","):
        seed, num_prompts = (int(part) for part in pair.split(":"))
        prompts = answer_prompts(num_prompts, seed=seed)
        verdicts = [verdict for verdict, _ in check_answers(model, tokenizer, prompts)]
        shares = [sum(v.reaches(level) for v in verdicts) / num_prompts for level in LEVELS]
        slots = Counter(slot for v in verdicts for slot in v.wrong_slots)
        print(
            f"{seed:>6} {num_prompts:>7} "
            + " ".join(f"{share:>9.1%}" for share in shares)
            + "  "
            + ", ".join(f"{slot} {count}" for slot, count in slots.most_common())
        )
    print("each level counts the answers that reach it (answercheck.LEVELS: each on top of the one before)")


if __name__ == "__main__":
    main()
