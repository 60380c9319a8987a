"""Counter-based Gaussian noise for the MD engine: the draws are a function of (seed, step, stream, index).

Why not a ``torch.Generator``: a generator's state advances with every replay of a captured step, also of a
step the engine throws away (a neighbour list went stale inside a block, the edge buffers overflowed) and
redoes. Noise keyed by the committed step number makes a run independent of when rebuilds happened, a restart
needs only (seed, step), and CPU and CUDA draw the same numbers (integer arithmetic, then float64).

The hash is Chris Wellons' ``lowbias32`` (xor-shift / multiply rounds on 32-bit words), keyed per step and
stream; 32-bit products are split into 16-bit halves so that int64 never overflows (torch has no uint32
arithmetic on every device). Uniforms become normals by Box-Muller. Statistics are tested in
tests/test_engine_rng.py (moments, independence across steps and streams).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["normal_noise", "NoiseSource"]

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B


def _mul32(x: Tensor | int, c: int) -> Tensor | int:
    """(x * c) mod 2^32 for 0 <= x < 2^32, without an int64 overflow (16-bit halves)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _mix(x: Tensor | int) -> Tensor | int:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def normal_noise(seed: int, step: Tensor, stream: int, n: int, device: torch.device | str) -> Tensor:
    """``n`` standard normal float64 draws for (seed, step, stream); ``step`` an int64 scalar tensor (device-side:
    capture-safe, no host read)."""
    key = _mix((_mix(int(seed) & _M32) ^ _mix((int(seed) >> 32) & _M32) ^ _mul32(int(stream) + 1, 0x9E3779B9))
               & _M32)
    step = step.to(torch.int64)
    k1 = _mix(_mix(key ^ (step & _M32)) ^ ((step >> 32) & _M32))
    k2 = _mix(k1 ^ 0x5BD1E995)
    index = torch.arange(2 * n, dtype=torch.int64, device=device)
    bits = _mix(_mix(index ^ k1) ^ k2)
    u = bits.to(torch.float64) * (1.0 / 2.0**32)
    u1 = 1.0 - u[:n]  # (0, 1]: the logarithm stays finite
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u[n:])


class NoiseSource:
    """Draws for the current step: ``source(stream, shape)`` -> float64 normals of ``shape``. The engine points
    ``step`` at its device step counter; tests may replace a source with one that replays given numbers."""

    def __init__(self, seed: int, step: Tensor) -> None:
        self.seed = int(seed)
        self.step = step

    def __call__(self, stream: int, shape: tuple[int, ...]) -> Tensor:
        return normal_noise(self.seed, self.step, stream, math.prod(shape), self.step.device).view(shape)
