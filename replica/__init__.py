"""Shoal's bundled serving engine. Importing this package never imports torch."""
