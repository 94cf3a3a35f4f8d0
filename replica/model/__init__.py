"""The decoder: config, layers, MoE feed-forward, checkpoint loading. Importing this package imports torch."""
