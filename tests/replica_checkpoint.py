"""A tiny Shoal checkpoint for tests: a BPE tokenizer trained on a slice of the demo corpus, the chat template's
tokenizer_config.json, and a randomly initialised Qwen2-MoE (2 layers, 8 experts top-2, a gated shared expert). Its
outputs are random but deterministic, which is all the server, router and engine tests need; builds in about a
second."""

from __future__ import annotations

from pathlib import Path

TINY_VOCAB = 512


def build_tiny_checkpoint(path: Path, *, seed: int = 0) -> Path:
    from replica.chat_template import write_tokenizer_config
    from replica.demo.corpus import TOOLS, generate_conversations, uses_tools
    from replica.model.config import ModelConfig
    from replica.model.loader import init_weights, save_checkpoint
    from replica.model.model import MoEForCausalLM
    from replica.tokenizer import train_bpe, training_text

    conversations = generate_conversations(200, seed=seed)
    tokenizer = train_bpe(
        [training_text(c, TOOLS if uses_tools(c) else None) for c in conversations], vocab_size=TINY_VOCAB
    )
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=64,
        shared_expert_gate=True,  # a shared expert is written as Qwen2-MoE's: gated, q/k/v bias, no q/k norm
        qkv_bias=True,
        qk_norm=False,
        max_position_embeddings=4096,
        eos_token_id=sorted(tokenizer.eos_token_ids),
    )
    model = MoEForCausalLM(config)
    init_weights(model, seed=seed, std=0.1)
    save_checkpoint(model, path)
    tokenizer.save(path / "tokenizer.json")
    write_tokenizer_config(path, model_max_length=config.max_position_embeddings)
    return path
