"""Memory planner: what a LoRA run needs, from config.json alone (no weights, no GPU), and settings that fit.

Lower layer: imports nothing from training code and never touches a device.
"""

from rocktune.planner.estimate import Estimate, RunSpec, estimate
from rocktune.planner.fit import Suggestion, TokenBudget, describe_fit, suggest_settings, suggest_token_budget
from rocktune.planner.shapes import ModelShape, load_shape

__all__ = ["Estimate", "ModelShape", "RunSpec", "Suggestion", "describe_fit", "estimate", "load_shape",
           "suggest_settings", "suggest_token_budget", "TokenBudget"]
