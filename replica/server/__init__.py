"""`shoal replica`'s HTTP side: OpenAI API, metrics under vLLM's names, KV events, around the engine."""
