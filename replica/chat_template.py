"""The demo model's chat template as Jinja, for engines and routers that render templates the Hugging Face way.

`CHAT_TEMPLATE` (chat_template.jinja, beside this file) renders exactly what `replica.tokenizer.apply_chat_template`
renders (messages, tools, the generation prompt), given messages whose tool-call `arguments` are objects, as vLLM
and the router pass them: `tests/unit/test_chat_template.py` holds the two equal over the demo's calibration chats,
tool chats and Japanese.
`write_tokenizer_config` writes it into a checkpoint's `tokenizer_config.json` beside its tokenizer.json, with the
special tokens a template reads (`eos_token`, `pad_token`; ChatML has no BOS).

The replica keeps its Python renderer, whose validation gives each malformed request its own 400 message; the
template raises on the same malformed inputs, with shorter messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from replica.tokenizer import ENDOFTEXT, IM_END

CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja").read_text(encoding="utf-8")
"""Jinja source of the demo's ChatML template (module docstring)."""


def tokenizer_config(*, model_max_length: int) -> dict[str, Any]:
    """The `tokenizer_config.json` of a Shoal checkpoint: the chat template and the special tokens it reads."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_config(folder: Path, *, model_max_length: int) -> Path:
    """Write `tokenizer_config.json` into a checkpoint folder; returns its path."""
    path = folder / "tokenizer_config.json"
    text = json.dumps(tokenizer_config(model_max_length=model_max_length), ensure_ascii=False, indent=2)
    path.write_text(text + "\n", encoding="utf-8")
    return path
