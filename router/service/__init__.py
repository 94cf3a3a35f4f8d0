"""The router's service around `router.policy`: HTTP front and proxy, replica pool, health checks, admin API and
metrics."""
