"""Runs the model for one engine step, behind one interface (base.Executor), picked in one place
(factory.make_executor): the torch reference executor or the fused CPU executor. With tensor parallelism
(start_tensor_parallel) the engine gets the TP executor, whose ranks each run one of those on their shard."""

from deltaserve.executor.base import Executor
from deltaserve.executor.factory import make_executor
from deltaserve.executor.tensor_parallel import TensorParallelError, start_tensor_parallel
from deltaserve.executor.torch_executor import TorchExecutor

__all__ = [
    "Executor", "TensorParallelError", "TorchExecutor", "make_executor", "start_tensor_parallel",
]
