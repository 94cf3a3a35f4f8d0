"""The replica server's shared state: the engine and its step hook (metrics, the speculation log, KV events)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from aiohttp import web

from replica.capture import CaptureSource, CaptureWriter
from replica.engine.engine import StepResult
from replica.grammar.matcher import GrammarCompiler
from replica.server.async_engine import AsyncEngine
from replica.server.kv_events import KVEventHub
from replica.server.metrics import ReplicaMetrics, SpeculationSummary
from replica.server.protocol import now_s
from replica.settings import ReplicaSettings
from replica.tokenizer import Tokenizer
from router.common.body_process import BodyProcess

log = logging.getLogger(__name__)

SUMMARY_INTERVAL_S = 10.0
"""Seconds between two speculative-decoding summary lines in the log, while drafts are being verified."""


@dataclass
class ServerState:
    """What the handlers share: the engine behind its thread, the tokenizer, metrics, KV events and capture."""

    settings: ReplicaSettings
    tokenizer: Tokenizer
    engine: AsyncEngine
    metrics: ReplicaMetrics
    events: KVEventHub
    model_name: str
    grammars: GrammarCompiler | None = None
    capture: CaptureWriter | None = None
    capture_source: CaptureSource | None = None
    created_s: int = field(default_factory=now_s)
    body_process: BodyProcess = field(default_factory=BodyProcess)
    """Reads bodies larger than `request_body.OFF_LOOP_BYTES` off the event loop."""
    _last_queries: int = 0
    _last_hits: int = 0
    _last_preemptions: int = 0
    speculation: SpeculationSummary = field(default_factory=SpeculationSummary)
    _last_summary_s: float = field(default_factory=time.monotonic)

    def on_step(self, result: StepResult) -> None:
        core = self.engine.engine
        bm = core.block_manager
        m, name = self.metrics, self.model_name
        m.num_running.labels(name).set(core.num_running)
        m.num_waiting.labels(name).set(self.engine.num_waiting)
        m.kv_usage.labels(name).set(bm.usage)
        m.prefix_queries.labels(name).inc(bm.prefix_queried_tokens - self._last_queries)
        m.prefix_hits.labels(name).inc(bm.prefix_hit_tokens - self._last_hits)
        m.preemptions.labels(name).inc(core.num_preemptions - self._last_preemptions)
        self._last_queries, self._last_hits = bm.prefix_queried_tokens, bm.prefix_hit_tokens
        self._last_preemptions = core.num_preemptions
        spec = result.speculation
        if spec.num_drafts:
            m.spec_drafts.labels(name).inc(spec.num_drafts)
            m.spec_draft_tokens.labels(name).inc(spec.num_draft_tokens)
            m.spec_accepted_tokens.labels(name).inc(spec.num_accepted_tokens)
            for position, n in enumerate(spec.accepted_per_position):
                m.spec_accepted_per_pos.labels(name, str(position)).inc(n)
            self.speculation.add(spec.num_drafts, spec.num_accepted_tokens, spec.accepted_per_position)
            now = time.monotonic()
            if now - self._last_summary_s >= SUMMARY_INTERVAL_S:
                self._last_summary_s = now
                self.log_speculation()
        self.events.publish(result.events)

    def log_speculation(self) -> None:
        line = self.speculation.line()
        if line is not None:
            log.info("%s", line)


STATE = web.AppKey("state", ServerState)
