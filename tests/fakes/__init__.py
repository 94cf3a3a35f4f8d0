"""Real in-process peers for the tests: servers on loopback that stand in for serving engines.

Imported lazily so that `python -m tests.fakes.fake_replica` runs the module once, as `__main__` only.
"""

from typing import Any

__all__ = ["FakeReplica", "FakeReplicaConfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tests.fakes import fake_replica

        return getattr(fake_replica, name)
    raise AttributeError(name)
