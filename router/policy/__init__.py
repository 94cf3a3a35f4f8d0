"""Pure routing decisions: block hashing, the prefix index and the routing policies.

Nothing here does I/O, awaits, reads the wall clock or keeps globals: the live router passes `loop.time()` and
the simulator its virtual clock as `now`, so both drive the very same decisions.
"""
