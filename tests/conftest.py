"""The whole test session's settings."""

from __future__ import annotations

import gc

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    """Keep what collection imported out of the collector's full passes, as `shoal router` and `shoal replica` keep
    what they loaded once started (`gc.freeze`). Collecting every test imports some 550,000 objects that live as long
    as the session; a full pass over them held the GIL about 0.3 s, in whichever test happened to trigger it, and the
    in-process servers of that test stalled with it."""
    gc.collect()
    gc.freeze()
