"""The spec tests share the engine tests' tiny model and one-thread fixture."""

from tests.unit.replica_engine.conftest import model, single_thread

__all__ = ["model", "single_thread"]
