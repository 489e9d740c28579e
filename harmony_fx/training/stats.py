"""A Trainer step's figures: the step's own beside the iteration's (the runtime's ``Stats``)."""
from __future__ import annotations

import dataclasses

__all__ = ["StepStats"]


@dataclasses.dataclass
class StepStats:
    """What ``Trainer.stats`` shows for the last step. The iteration's figures (bytes moved, peaks,
    busy time, the timeline) are the runtime's ``Stats``, read through this object; the fields here
    are the step's own, written by the Trainer's update and commit."""

    iteration: object  # the runtime's ``Stats`` of the step's iteration
    # the host optimizer's time, and the part of it the step waited for once the iteration ended;
    # of the optimizer's time, that of the copies a failed step would be put back from (atomic)
    update_seconds: float = 0.0
    update_exposed_seconds: float = 0.0
    undo_seconds: float = 0.0
    # the global norm of the step's gradients before clipping (Trainer(max_grad_norm=...)), else None
    grad_norm: float | None = None
    # bytes this process sent to other processes (across processes), per collective
    network_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # the NVMe tier: bytes read and written, the reader's and writer's busy time (filled in once the
    # step is committed, while the next step runs), the time the updates waited for state the tier
    # had not read yet (the last step's commit included), and the most state bytes in host memory on
    # the tier's way at once
    tier_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    tier_seconds: float = 0.0
    tier_wait_seconds: float = 0.0
    tier_staged_peak: int = 0

    def __getattr__(self, name: str):
        if name == "iteration":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.iteration, name)

    def as_dict(self) -> dict:
        return {**self.iteration.as_dict(), "update_seconds": self.update_seconds,
                "update_exposed_seconds": self.update_exposed_seconds, "undo_seconds": self.undo_seconds,
                "grad_norm": self.grad_norm, "network_bytes": dict(self.network_bytes)}
