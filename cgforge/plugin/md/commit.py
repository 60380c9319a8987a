"""The engine's commit-or-discard rule: after each step of a block, on the device, whether the step counts.

A step whose positions went beyond the Verlet list's reach (``stale``), whose edges overflowed the captured
buffers (``overflow``), or that blew up (non-finite energy or forces, temperature above the limit) is not
committed, nor is any later step of its block; the block's ``REPORT`` (one float64 per name) tells the host
what happened, in one copy.
"""

from __future__ import annotations

import torch
from ase import units
from torch import Tensor

from cgforge.kernels.md_step import COMMIT_REPORT, commit_check_cuda

from .integrators import kinetic

__all__ = ["BLOW_KINDS", "REPORT", "MDBlowUp", "commit_step", "commit_step_reference"]

REPORT = COMMIT_REPORT  # the CUDA kernel writes the fields in this order
BLOW_KINDS = {1: "energy", 2: "forces", 3: "temperature"}


_KERNEL_DTYPES = (torch.float64,) * 5 + (torch.int64, torch.bool, torch.bool, torch.int64, torch.float64)


def commit_step(energy: Tensor, forces: Tensor, momenta: Tensor, masses: Tensor, step: Tensor, stale: Tensor,
                overflow: Tensor, count: Tensor, slack: Tensor, max_temperature_K: float, report: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
    """After a step: (bad, step, report). bad: the step ran on a stale list or overflowed buffers, blew up, or an
    earlier step of the block stopped it (the caller restores the state); step + 1 if not; the block's report
    (float64 [len(REPORT)], flags 0/1) updated. Pure: the engine fuses it with ``fuse_integrator``, as the
    integrators' arithmetic (torch.compile dropped in-place updates of 0-d CPU tensors, torch 2.13). On CUDA and
    not under torch.compile two kernels (``cgforge.kernels.md_step``) where the torch expression
    (``commit_step_reference``) is ~60."""
    tensors = (energy, forces, momenta, masses, report, step, stale, overflow, count, slack)
    if (forces.is_cuda and not torch.compiler.is_compiling()
            and all(t.is_cuda and t.dtype == d and t.is_contiguous() for t, d in zip(tensors, _KERNEL_DTYPES))):
        return commit_check_cuda(energy, forces, momenta, masses, step, stale, overflow, count, slack, report,
                                 1.5 * momenta.shape[0] * units.kB, float(max_temperature_K))
    return commit_step_reference(energy, forces, momenta, masses, step, stale, overflow, count, slack,
                                 max_temperature_K, report)


def commit_step_reference(energy: Tensor, forces: Tensor, momenta: Tensor, masses: Tensor, step: Tensor,
                          stale: Tensor, overflow: Tensor, count: Tensor, slack: Tensor, max_temperature_K: float,
                          report: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``commit_step`` as torch operations (any device; what torch.compile traces)."""
    rep = dict(zip(REPORT, report.unbind(0), strict=True))
    temperature = kinetic(momenta, masses) / (1.5 * momenta.shape[0] * units.kB)
    bad_energy = ~torch.isfinite(energy)
    bad_forces = ~torch.isfinite(forces).all()
    hot = ~(temperature <= max_temperature_K)
    kind = torch.where(bad_energy, 1.0, torch.where(bad_forces, 2.0, torch.where(hot, 3.0, 0.0)))
    value = torch.where(bad_energy, energy, torch.where(bad_forces, forces.abs().amax(), temperature))
    invalid = stale | overflow
    blow = ~invalid & (kind > 0)
    stopped = rep["stopped"] > 0
    fresh = ~stopped
    bad = stopped | invalid | blow
    new_blow = blow & fresh
    good = ~bad
    new = {
        "committed": rep["committed"] + good.to(report.dtype),
        "stopped": bad.to(report.dtype),
        "stale": ((rep["stale"] > 0) | (stale & fresh)).to(report.dtype),
        "overflow": ((rep["overflow"] > 0) | (overflow & fresh)).to(report.dtype),
        "blow_kind": torch.where(new_blow, kind, rep["blow_kind"]),
        "blow_step": torch.where(new_blow, (step + 1).to(report.dtype), rep["blow_step"]),
        "blow_value": torch.where(new_blow, value.to(report.dtype), rep["blow_value"]),
        "count_max": torch.maximum(rep["count_max"], torch.where(fresh, count.to(report.dtype), 0.0)),
        "slack": torch.where(good, slack.to(report.dtype), rep["slack"]),
        "temperature": torch.where(good, temperature, rep["temperature"]),
    }
    return bad, step + good.to(step.dtype), torch.stack([new[name] for name in REPORT])


class MDBlowUp(RuntimeError):
    """The simulation blew up: ``quantity`` ('energy', 'forces', 'temperature' or 'displacement') took ``value`` at
    ``step`` (the step that was not committed; the engine's state is the step before)."""

    def __init__(self, step: int, quantity: str, value: float, detail: str = "") -> None:
        self.step, self.quantity, self.value = int(step), quantity, float(value)
        super().__init__(f"MD blew up at step {self.step}: {quantity} {value:.6g}{detail}; the engine's state is that "
                         f"of step {self.step - 1}")
