"""Speculative decoding's drafters (dense and block), their checkpoints, and their training on captured token ids."""
