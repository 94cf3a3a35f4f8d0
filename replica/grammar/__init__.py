"""Constrained decoding: grammars from JSON schemas and tool definitions, and per-request matchers (llguidance)."""
