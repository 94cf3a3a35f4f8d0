"""Grammars for what an OpenAI request asks of its output: a JSON schema, any JSON object, or tool calls.

Every grammar is llguidance's (a JSON schema compiled with `LLMatcher.grammar_from_json_schema`, or a Lark grammar
with `%json` rules). JSON is written with fixed separators, `", "` and `": "` and no other whitespace, the layout
`json.dumps` gives and the demo model learnt: a sampled model then cannot pad its answer with whitespace forever,
and a strict schema and a lenient one compile alike (both are enforced: an output always fits its schema).

Tool calls take the chat template's form (`replica.tokenizer`): `<tool_call>`, a newline, `{"name": ..., "arguments":
{...}}` with the arguments under the function's parameter schema, a newline, `</tool_call>`; calls are separated by
a newline. The markers are the tokenizer's atomic tokens (`<[id]>` in Lark), so a call opens only with the token
the model writes for it, never with text that spells it out. `tool_choice`:
- `required`: the output is one call, several with parallel_tool_calls; a named function: one call of it;
- `auto`: free text without the markers, then optionally the calls: once the model writes `<tool_call>`, the rest
  is constrained;
- `none`: no grammar; the server offers no tools to the template.

`check_schema` bounds what a client can make the replica compile: nesting depth and size of the schema document
(so that neither llguidance nor this walk recurses without bound). llguidance's own validation then names
unsupported keywords, invalid schemas and unsatisfiable ones (`GrammarCompiler.validate`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from replica.grammar.matcher import GrammarError

JSON_OPTIONS: Final[JsonCompileOptions] = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
MAX_SCHEMA_DEPTH: Final = 32
"""Nesting of objects and arrays in a schema document; real tool and response schemas stay under 10."""
MAX_SCHEMA_BYTES: Final = 64 * 1024
"""Size of a schema (or of all tools' parameter schemas) as JSON; OpenAI's own limits are of this order."""


def check_schema(schema: Any, where: str) -> None:
    """GrammarError when `schema` is not a JSON object (or boolean) or is nested or sized past the limits."""
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"{where} must be a JSON object, got {type(schema).__name__}")
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"{where} is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted")


def json_schema_grammar(schema: Any, where: str = "schema") -> str:
    check_schema(schema, where)
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS))
    except ValueError as exc:
        raise GrammarError(f"{where}: {exc}") from None


def json_object_grammar() -> str:
    return json_schema_grammar({"type": "object"})


def _call_schema(function: Mapping[str, Any], where: str) -> dict[str, Any]:
    parameters = function.get("parameters", {"type": "object"})
    check_schema(parameters, f"{where}.parameters")
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_OPTIONS,
    }


def tool_call_grammar(
    functions: Sequence[Mapping[str, Any]],
    *,
    call_start_id: int,
    call_end_id: int,
    is_forced: bool,
    is_parallel: bool,
) -> str:
    """A Lark grammar of the calls of `functions` (OpenAI function objects with name and parameters); with
    `is_forced` the output is calls only, else free text then optional calls (tool_choice auto)."""
    if not functions:
        raise GrammarError("no function to call")
    total = sum(len(json.dumps(f.get("parameters", {}), default=str)) for f in functions)
    if total > MAX_SCHEMA_BYTES:  # each is checked too; this bounds what one request compiles in all
        raise GrammarError(
            f"the tools' parameter schemas are {total} bytes of JSON together; at most {MAX_SCHEMA_BYTES} are accepted"
        )
    rules = []
    for index, function in enumerate(functions):
        rules.append(f"fn{index}: %json {json.dumps(_call_schema(function, f'tools[{index}].function'))}")
    body = " | ".join(f"fn{i}" for i in range(len(functions)))
    calls = 'call ("\\n" call)*' if is_parallel else "call"
    start = f"start: {calls}" if is_forced else f"start: <[^{call_start_id},{call_end_id}]>* ({calls})?"
    lines = [start, f'call: <[{call_start_id}]> "\\n" body "\\n" <[{call_end_id}]>', f"body: {body}", *rules]
    return str(llguidance.LLMatcher.grammar_from_lark("\n".join(lines)))
