"""Pure scaling decisions: `decide(observation, state, config, *, now) -> (ScaleDecision, state)`.

stdlib and pydantic only: no I/O, no asyncio, no clock of its own. The controller and the simulator drive the same
function; see `decide.py` for the algorithm and `config.py` for every parameter and why its default is what it is.
"""

from autoscaler.policy.config import (
    MetricsConfig,
    PanicConfig,
    ScaleDownConfig,
    ScaleToZeroConfig,
    ScaleUpConfig,
    ScalingPolicyConfig,
)
from autoscaler.policy.decide import decide, is_start_overdue
from autoscaler.policy.types import (
    Action,
    Cap,
    Demand,
    Observation,
    Reason,
    ScaleDecision,
    ScalerState,
    Signal,
    Window,
)

__all__ = [
    "Action",
    "Cap",
    "Demand",
    "MetricsConfig",
    "Observation",
    "PanicConfig",
    "Reason",
    "ScaleDecision",
    "ScaleDownConfig",
    "ScaleToZeroConfig",
    "ScaleUpConfig",
    "ScalerState",
    "ScalingPolicyConfig",
    "Signal",
    "Window",
    "decide",
    "is_start_overdue",
]
