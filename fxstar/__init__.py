"""fxstar: train PyTorch models larger than accelerator memory by compiling the training step.

engine = fxstar.compile(model, fxstar.Plan(...), example_inputs=(idx, targets))
loss = engine(idx, targets); loss.backward(); engine.step()
print(fxstar.dump(engine)); print(fxstar.diff(engine, "capture", "shape_memory"))
"""

from fxstar import _C, passes
from fxstar.capture import capture
from fxstar.dump import diff, draw, dump, note
from fxstar.engine import Engine, compile
from fxstar.errors import (
    CaptureError,
    CollectiveError,
    DiskIOError,
    EngineStateError,
    FxstarError,
    IRError,
    OptionNotImplementedError,
    PassOrderError,
    RankMismatchError,
    TargetError,
    UsageError,
    VerifyError,
)
from fxstar.placement import HostMemoryError
from fxstar.plan import (
    LossScaleConfig,
    OptimizerConfig,
    Plan,
    PlanError,
    TensorParallelConfig,
    TiledLinearConfig,
)
from fxstar.program import Program, Stage
from fxstar.runtime.grad_copies import GradientConsumedError
from fxstar.saving import Checkpoint, CheckpointError, load

__version__ = "0.1.0"
__all__ = [
    "CaptureError",
    "Checkpoint",
    "CheckpointError",
    "CollectiveError",
    "DiskIOError",
    "Engine",
    "EngineStateError",
    "FxstarError",
    "GradientConsumedError",
    "HostMemoryError",
    "IRError",
    "LossScaleConfig",
    "OptimizerConfig",
    "OptionNotImplementedError",
    "PassOrderError",
    "Plan",
    "PlanError",
    "Program",
    "RankMismatchError",
    "Stage",
    "TensorParallelConfig",
    "TargetError",
    "TiledLinearConfig",
    "UsageError",
    "VerifyError",
    "_C",
    "capture",
    "compile",
    "diff",
    "draw",
    "dump",
    "note",
    "load",
    "passes",
]
