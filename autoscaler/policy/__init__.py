"""Pure scaling decisions: `decide(observation, state, config, *, now) -> (ScaleDecision, state)`.

stdlib and pydantic only: no I/O, no asyncio, no clock of its own. The controller and the simulator drive the same
function; see `decide.py` for the algorithm and `config.py` for every parameter and why its default is what it is.
`baselines.py` holds the HPA, KEDA and static policies the simulator compares it with.
"""

from autoscaler.policy.baselines import (
    BaselineDecision,
    BaselineReason,
    HPAConfig,
    KEDAConfig,
    StaticConfig,
    hpa_decide,
    keda_decide,
    static_decide,
)
from autoscaler.policy.config import (
    CapacityConfig,
    ForecastConfig,
    MetricsConfig,
    PanicConfig,
    ScaleDownConfig,
    ScaleToZeroConfig,
    ScaleUpConfig,
    ScalingPolicyConfig,
)
from autoscaler.policy.decide import decide, is_start_overdue
from autoscaler.policy.demand import fleet_demand
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
    "BaselineDecision",
    "BaselineReason",
    "Cap",
    "CapacityConfig",
    "Demand",
    "ForecastConfig",
    "HPAConfig",
    "KEDAConfig",
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
    "StaticConfig",
    "Window",
    "decide",
    "fleet_demand",
    "hpa_decide",
    "is_start_overdue",
    "keda_decide",
    "static_decide",
]
