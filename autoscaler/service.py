"""The autoscaler's own `/metrics` and `/health`, on a registry of its own (never the global one).

`AutoscalerMetrics` is updated by the controller after every decision; `create_app(metrics)` serves it. The
controller does not run inside this app: under leader election only the leader decides, while every candidate
serves its metrics.
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from autoscaler.policy.types import ScaleDecision, Signal
from router.service.supervise import TaskFailures


class AutoscalerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.desired = Gauge("shoal_autoscaler_desired_replicas", "Replicas the last decision asked for", registry=r)
        self.current = Gauge(
            "shoal_autoscaler_current_replicas", "Ready plus starting replicas within their deadline", registry=r
        )
        self.ready = Gauge("shoal_autoscaler_ready_replicas", "Replicas that serve", registry=r)
        self.starting = Gauge("shoal_autoscaler_starting_replicas", "Replicas on their way", registry=r)
        self.draining = Gauge("shoal_autoscaler_draining_replicas", "Replicas being drained for removal", registry=r)
        self.failed = Gauge("shoal_autoscaler_failed_replicas", "Replicas failed or past their deadline", registry=r)
        self.decisions = Counter(
            "shoal_autoscaler_decisions", "Decisions, by reason and action", ["reason", "action"], registry=r
        )
        self.capped = Counter("shoal_autoscaler_capped_decisions", "Decisions limited by a cap", ["cap"], registry=r)
        self.signal_desired = Gauge(
            "shoal_autoscaler_signal_desired_replicas", "Replicas each signal asks for", ["signal"], registry=r
        )
        self.panicking = Gauge("shoal_autoscaler_panic", "1 while panic mode is on", registry=r)
        self.target_requests = Gauge(
            "shoal_autoscaler_target_requests_per_replica",
            "Requests per replica the last decision sized on (learnt with capacity.learn_target)",
            registry=r,
        )
        self.metrics_age = Gauge(
            "shoal_autoscaler_metrics_age_seconds", "Age of the routers' figures at the last decision", registry=r
        )
        self.removals = Counter(
            "shoal_autoscaler_removals",
            "Replicas removed, by outcome (drained, drain_timeout, failed, cancelled)",
            ["outcome"],
            registry=r,
        )
        self.errors = Counter("shoal_autoscaler_errors", "Failed steps of the loop, by stage", ["stage"], registry=r)
        self.is_leader = Gauge("shoal_autoscaler_leader", "1 while this process runs the control loop", registry=r)
        self.tasks = TaskFailures(logging.getLogger("shoal.autoscaler.tasks"))
        """Failures of the control loop and of removals that the loop did not foresee (router/service/supervise.py):
        `shoal_autoscaler_task_failures_total{task}` and `shoal_autoscaler_tasks_down{task}`."""
        r.register(self.tasks.collector("shoal_autoscaler"))

    def record(
        self,
        decision: ScaleDecision,
        *,
        ready: int,
        starting: int,
        draining: int,
        failed: int,
        metrics_age_s: float | None,
    ) -> None:
        self.desired.set(decision.target_replicas)
        self.current.set(decision.current_replicas)
        self.ready.set(ready)
        self.starting.set(starting)
        self.draining.set(draining)
        self.failed.set(failed)
        self.decisions.labels(decision.reason.value, decision.action.value).inc()
        if decision.cap is not None:
            self.capped.labels(decision.cap.value).inc()
        for signal in Signal:
            if signal in decision.desired_by_signal:
                self.signal_desired.labels(signal.value).set(decision.desired_by_signal[signal])
        self.panicking.set(1 if decision.is_panicking else 0)
        if decision.target_requests_per_replica is not None:
            self.target_requests.set(decision.target_requests_per_replica)
        if metrics_age_s is not None:
            self.metrics_age.set(metrics_age_s)


METRICS = web.AppKey("metrics", AutoscalerMetrics)


def create_app(metrics: AutoscalerMetrics) -> web.Application:
    app = web.Application()
    app[METRICS] = metrics
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/health", _health)
    return app


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})
