"""Counter-based Gaussian noise for the MD engine: the draws are a function of (seed, step, stream, index).

Why not a ``torch.Generator``: a generator's state advances with every replay of a captured step, also of a
step the engine throws away (a neighbour list went stale inside a block, the edge buffers overflowed) and
redoes. Noise keyed by the committed step number makes a run independent of when rebuilds happened, a restart
needs only (seed, step), and CPU and CUDA draw the same numbers (integer arithmetic, then float64).

The hash is Chris Wellons' ``lowbias32`` (xor-shift / multiply rounds on 32-bit words held in int64), keyed
per step and stream, three rounds per draw with independent round keys. A product of two 32-bit words can pass
2^63: torch's int64 multiply wraps (two's complement) on CPU and CUDA, and only the low 32 bits are kept, so the
result is exact; the safe 16-bit split (``_mul32_exact``) is the test's reference, and a CUDA test checks that
both devices draw the same numbers.
Uniforms become normals by Box-Muller. The CUDA kernel (``cgforge.kernels.noise``, compiled through the kernels'
one compile path) draws the same numbers as ``normal_noise_reference``. Statistics are tested in
tests/md/test_engine_rng.py (moments, a Kolmogorov-Smirnov test, independence across steps, streams and seeds).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from cgforge.kernels.noise import NORMAL_NOISE_SOURCE, normal_noise_cuda

__all__ = ["normal_noise", "normal_noise_reference", "NoiseSource", "SystemNoise", "NORMAL_NOISE_SOURCE"]

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B


def _mul32_exact(x: Tensor | int, c: int) -> Tensor | int:
    """(x * c) mod 2^32 for 0 <= x < 2^32 without an int64 overflow (16-bit halves): the reference."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _mix(x: Tensor | int) -> Tensor | int:
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def _stream_key(seed: int, stream: int) -> int:
    return _mix((_mix(seed & _M32) ^ _mix((seed >> 32) & _M32 ^ 0x68E31DA4) ^ _mix(stream + 1)) & _M32)


def hashed_bits(key: int | Tensor, step: Tensor, index: Tensor) -> Tensor:
    """The hashed 32-bit words (int64 in [0, 2^32)) at draw ``index`` of the stream ``key`` (``_stream_key`` of
    (seed, stream); a tensor: one key per index) for ``step``."""
    step = step.to(torch.int64)
    k1 = _mix(key ^ (step & _M32) ^ (((step >> 32) * 0x27D4EB2F) & _M32))
    k2 = _mix(k1 ^ 0x9E3779B9)  # independent round keys: no related-key structure between the rounds
    k3 = _mix(k2 ^ 0x85EBCA6B)
    return _mix(_mix(_mix(index ^ k1) ^ k2) ^ k3)


def uniform_bits(seed: int, step: Tensor, stream: int, n: int, device: torch.device | str) -> Tensor:
    """``n`` hashed 32-bit words (int64 in [0, 2^32)) for (seed, step, stream)."""
    return hashed_bits(_stream_key(int(seed), int(stream)), step, torch.arange(n, dtype=torch.int64, device=device))


def polar(radius_bits: Tensor, angle_bits: Tensor) -> tuple[Tensor, Tensor]:
    """Box-Muller's radius and angle from two hashed words: the normals are radius * (cos, sin)(angle)."""
    scale = 1.0 / 2.0**32
    radius = torch.sqrt(-2.0 * torch.log(1.0 - radius_bits.to(torch.float64) * scale))  # 1 - u in (0, 1]
    return radius, (2.0 * math.pi) * (angle_bits.to(torch.float64) * scale)


def normal_noise(seed: int, step: Tensor, stream: int, n: int, device: torch.device | str) -> Tensor:
    """``n`` standard normal float64 draws for (seed, step, stream); ``step`` an int64 scalar tensor (device-side:
    capture-safe, no host read). On CUDA one kernel, on a CPU the torch expression (the same numbers)."""
    device = torch.device(device)
    if device.type == "cuda" and n > 0 and n < 2**32:
        return normal_noise_cuda(_stream_key(int(seed), int(stream)), step, n, device)
    return normal_noise_reference(seed, step, stream, n, device)


def normal_noise_reference(seed: int, step: Tensor, stream: int, n: int, device: torch.device | str) -> Tensor:
    """``normal_noise`` as torch operations on any device (the CPU path, and the CUDA kernel's reference)."""
    half = (n + 1) // 2
    bits = uniform_bits(seed, step, stream, 2 * half, device)
    radius, angle = polar(bits[:half], bits[half:])
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:n]  # both Box-Muller outputs


class NoiseSource:
    """Draws for the current step: ``source(stream, shape)`` -> float64 normals of ``shape``. The engine points
    ``step`` at its device step counter; tests may replace a source with one that replays given numbers."""

    def __init__(self, seed: int, step: Tensor) -> None:
        self.seed = int(seed)
        self.step = step

    def __call__(self, stream: int, shape: tuple[int, ...]) -> Tensor:
        return normal_noise(self.seed, self.step, stream, math.prod(shape), self.step.device).view(shape)


class SystemNoise:
    """The draws of a batch of independent systems, system b with its own seed ``seeds[b]``: each system gets
    exactly the numbers that ``NoiseSource(seeds[b], step)`` gives it alone, whatever the batch's other members
    (the torch expression of ``normal_noise_reference`` over the whole batch at once: one set of kernels
    whatever the number of systems).

    ``source(stream, shape)``, ``shape`` (..., N, 3) over the batch's N atoms laid end to end (system b owns
    atoms ptr[b] .. ptr[b + 1] - 1): system b's ``(..., n_b, 3)`` draws at its atoms' rows.
    ``source.per_system(stream, counts)``: system b's ``counts[b]`` draws, the systems' end to end."""

    def __init__(self, seeds: list[int], ptr: list[int], step: Tensor) -> None:
        if len(seeds) != len(ptr) - 1:
            raise ValueError(f"seeds: expected one per system ({len(ptr) - 1}), got {len(seeds)}")
        self.seeds, self.ptr, self.step = [int(s) for s in seeds], list(ptr), step
        self._layouts: dict[tuple, tuple[Tensor, ...]] = {}

    def _layout(self, stream: int, draws: list[Tensor], counts: list[int]) -> tuple[Tensor, ...]:
        """Per output element: its system's stream key, the hashed indices of its radius and angle, and whether it
        is a sine; ``draws[b]``: which of system b's ``counts[b]`` draws each of its elements is."""
        keys, radius, angle, sine = [], [], [], []
        for seed, j, n in zip(self.seeds, draws, counts, strict=True):
            half = (n + 1) // 2  # as normal_noise_reference: cosines of the first half, then sines
            k = torch.where(j < half, j, j - half)
            keys.append(torch.full_like(j, _stream_key(seed, int(stream))))
            radius.append(k)
            angle.append(k + half)
            sine.append(j >= half)
        return tuple(torch.cat(parts, -1).reshape(-1) for parts in (keys, radius, angle, sine))

    def _draw(self, cache_key: tuple, make: Callable[[], tuple[Tensor, ...]]) -> Tensor:
        layout = self._layouts.get(cache_key)
        if layout is None:
            layout = self._layouts[cache_key] = make()
        keys, radius_index, angle_index, sine = layout
        radius, angle = polar(hashed_bits(keys, self.step, radius_index), hashed_bits(keys, self.step, angle_index))
        return radius * torch.where(sine, torch.sin(angle), torch.cos(angle))

    def __call__(self, stream: int, shape: tuple[int, ...]) -> Tensor:
        if len(shape) < 2 or tuple(shape[-2:]) != (self.ptr[-1], 3):
            raise ValueError(f"shape: expected (..., {self.ptr[-1]}, 3) over the batch's atoms, got {shape}")
        lead, device = math.prod(shape[:-2]), self.step.device
        sizes = [3 * (end - start) for start, end in zip(self.ptr[:-1], self.ptr[1:])]

        def make() -> tuple[Tensor, ...]:
            # element (l, atom, c) of system b is its draw l * 3 n_b + 3 atom + c, as the system alone lays them
            draws = [torch.arange(lead, device=device)[:, None] * size + torch.arange(size, device=device)
                     for size in sizes]
            return self._layout(stream, draws, [lead * size for size in sizes])

        return self._draw(("atoms", stream, tuple(shape)), make).view(shape)

    def per_system(self, stream: int, counts: list[int]) -> Tensor:
        def make() -> tuple[Tensor, ...]:
            return self._layout(stream, [torch.arange(n, device=self.step.device) for n in counts], list(counts))

        return self._draw(("systems", stream, tuple(counts)), make)
