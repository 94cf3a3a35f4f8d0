"""The whole test session's settings."""

from __future__ import annotations

import pytest

from router.common.heap import freeze_loaded


def pytest_collection_finish(session: pytest.Session) -> None:
    """Keep what collection imported out of the collector's full passes, as `shoal router` and `shoal replica` keep
    what they loaded once started (`gc.freeze`). Collecting every test imports some 550,000 objects that live as long
    as the session; full passes over them held the GIL 0.2-0.6 s, in whichever test happened to trigger one, and the
    in-process servers of that test stalled with it. Over the integration tests, full passes of more than 0.25 s went
    from 13 to 1 (in a vLLM test, its engines busy on both cores)."""
    freeze_loaded()
