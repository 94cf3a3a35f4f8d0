"""The aiohttp service around `router.policy`: proxy, replica pool, health checks, admin API and metrics."""
