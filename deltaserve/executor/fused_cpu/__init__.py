"""The fused CPU executor: the trunk's and the MTP head's forward as one C++ call per step
(deltaserve/ops/csrc), with the Python model's weights as its source."""

from deltaserve.executor.fused_cpu.executor import FusedCPUExecutor
from deltaserve.executor.fused_cpu.stack import FusedMTP, FusedTrunk, supported

__all__ = ["FusedCPUExecutor", "FusedMTP", "FusedTrunk", "supported"]
