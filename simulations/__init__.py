"""Offline replay of real traces through the real routing policies (DESIGN.md, Simulations).

A discrete-event simulator: `events` (the clock and heap), `replica` (a vLLM-V1-like engine: continuous batching,
chunked prefill, preemption) over `kv_cache` (fixed-size blocks, LRU prefix cache on the router's chained hashes)
timed by `step_model` (presets in `presets/`), `routing` (the live router's routing steps around the real
`router.policy` objects and `PrefixIndex`), `workload`/`traces`/`synthetic` (what is replayed), `scaling` (the
autoscaling hook), `simulation` (one run), `metrics`, `floor`, `report`, `plots` and `cli` (`shoal simulate`).
Nothing here reads the wall clock or an unseeded random source; the progress bar is the only thing that looks at
time, and it only displays.
"""
