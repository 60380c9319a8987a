"""The engine's commit-or-discard rule: after each step of a block, on the device, whether the step counts.

A step that went stale, overflowed the captured buffers or blew up is not committed, nor is any later step of
its block; the block's ``REPORT`` (one float64 per name) tells the host what happened, in one copy.
"""

from __future__ import annotations

from ase import units
from torch import Tensor

from cgforge.kernels.md_step import COMMIT_REPORT, commit_check

REPORT = COMMIT_REPORT  # the CUDA kernel writes the fields in this order
BLOW_KINDS = {1: "energy", 2: "forces", 3: "temperature"}


def commit_step(energy: Tensor, forces: Tensor, momenta: Tensor, masses: Tensor, step: Tensor, stale: Tensor,
                overflow: Tensor, count: Tensor, slack: Tensor, max_temperature_K: float, report: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
    """After a step: (bad, step, report) of ``cgforge.kernels.md_step.commit_check``, the temperature in K. Pure
    (torch.compile dropped in-place updates of 0-d CPU tensors): the engine fuses it as the integrators."""
    return commit_check(energy, forces, momenta, masses, step, stale, overflow, count, slack, report,
                        1.5 * momenta.shape[0] * units.kB, max_temperature_K)


class MDBlowUp(RuntimeError):
    """The simulation blew up: ``quantity`` ('energy', 'forces', 'temperature' or 'displacement') took ``value`` at
    ``step`` (the step that was not committed; the engine's state is the step before)."""

    def __init__(self, step: int, quantity: str, value: float, detail: str = "") -> None:
        self.step, self.quantity, self.value = int(step), quantity, float(value)
        super().__init__(f"MD blew up at step {self.step}: {quantity} {value:.6g}{detail}; the engine's state is that "
                         f"of step {self.step - 1}")
