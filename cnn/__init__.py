"""CNN training under a fast-memory budget (dissertation sections 4.5-4.7).

Layers run jitted JAX kernels on CachedArrays handed over zero-copy
(`cnn.execute`); every weight, activation, gradient and momentum buffer is a
CachedArray, so the policy sees and moves all of them.  `cnn.annotate` wraps
layers with the hints of Listing 4.6; `cnn.modes` maps the operating modes of
Table 4.7 to policies; `python -m cnn.train --help` runs it all.
"""

import os

# The trainer dispatches one XLA program per layer, and on a GPU the host time of a launch bounds
# its step: XLA launching every program as CUDA graphs (command buffers), cuDNN and library calls
# included and however small the program, took a ResNet-50 step's dispatch time from 31.5 to 25.2
# ms on an H200 host, the kernels unchanged.  Read when JAX starts its GPU backend; flags the
# user set for command buffers win.
if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
                               "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1").strip()

from .annotate import Annotations  # noqa: E402
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
