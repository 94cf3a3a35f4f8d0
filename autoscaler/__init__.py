"""Shoal's autoscaler: scales replicas on the router's queue metrics (arrives with its own issue)."""
