"""Offline replay of real traces through the real routing and scaling policies (arrives with its own issue)."""
