"""Shoal's autoscaler: scales replicas on the routers' queue metrics (DESIGN.md, Autoscaler)."""
