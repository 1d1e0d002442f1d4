"""CNN training under a fast-memory budget (dissertation sections 4.5-4.7).

Layers run jitted JAX kernels on CachedArrays handed over zero-copy
(`cnn.execute`); every weight, activation, gradient and momentum buffer is a
CachedArray, so the policy sees and moves all of them.  `cnn.annotate` wraps
layers with the hints of Listing 4.6; `cnn.modes` maps the operating modes of
Table 4.7 to policies; `python -m cnn.train --help` runs it all.
"""

from .annotate import Annotations
from .execute import Executor, KernelStats
from .graph import Node, Tape
from .models import Model, build, densenet, resnet, vgg
from .modes import CA_MODES, MODES, BudgetTooSmallError, make_manager, make_policy, parse_budget
from .optim import SGD
from .trainer import Config, Footprint, IterationRecord, RunResult, Session, Trainer, measure_footprint, run_mode

__all__ = [
    "Annotations", "BudgetTooSmallError", "CA_MODES", "Config", "Executor", "Footprint", "IterationRecord",
    "KernelStats", "MODES", "Model", "Node", "RunResult", "SGD", "Session", "Tape", "Trainer", "build", "densenet",
    "make_manager", "make_policy", "measure_footprint", "parse_budget", "resnet", "run_mode", "vgg",
]
