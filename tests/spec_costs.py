"""Step costs given rather than measured, for tests of adaptive k that timing must not decide."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class FixedCosts:
    """Step costs given, not measured (spec_policy.StepCosts): seconds = fixed + per_row * rows for a step,
    per_draft_row * rows for a draft pass."""

    fixed: float
    per_row: float
    per_draft_row: float

    def step(self, rows: int) -> float:
        return self.fixed + self.per_row * rows

    def step_measured(self, rows: int) -> bool:
        return True

    def draft(self, level: int, rows: int) -> float:
        return self.per_draft_row * rows

    def record_step(self, rows: int, seconds: float) -> None:
        pass

    def record_draft(self, level: int, rows: int, seconds: float) -> None:
        pass


MEMORY_BOUND = FixedCosts(fixed=1.0, per_row=0.001, per_draft_row=0.001)  # extra rows nearly free
COMPUTE_BOUND = FixedCosts(fixed=0.0, per_row=1.0, per_draft_row=0.3)  # every row costs a decode row
