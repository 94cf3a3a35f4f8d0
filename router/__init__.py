"""Shoal's cache-aware router.

`router.policy` is pure (hashing, prefix index, routing policies) and is shared with the replica and the
simulator; `router.service` is the aiohttp proxy around it. Importing this package imports neither aiohttp nor
torch: the service is loaded only by `shoal router`.
"""
