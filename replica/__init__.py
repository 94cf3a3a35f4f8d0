"""Shoal's bundled serving engine (arrives with its own issue). Importing this package never imports torch."""
