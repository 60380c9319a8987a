"""Counter-based Gaussian noise for the MD engine: the draws are a function of (seed, step, stream, index), as
torch operations (``normal_noise_reference``: the reference and the CPU path) and as one CUDA kernel that draws
the same numbers (``normal_noise_cuda``); ``normal_noise`` picks one.

Keyed by the committed step, not a ``torch.Generator`` (why: docs/md.md). The hash is Chris Wellons' ``lowbias32``
(xor-shift / multiply rounds on 32-bit words held in int64; the int64 multiply wraps and only the low 32 bits are
kept, so it is exact: ``_mul32_exact`` is the test's reference), three rounds per draw with independent keys;
uniforms become normals by Box-Muller.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .core.registry import SourceKernels

__all__ = ["NORMAL_NOISE_SOURCE", "hashed_bits", "normal_noise", "normal_noise_cuda", "normal_noise_reference",
           "polar", "stream_key", "uniform_bits"]

NORMAL_NOISE_SOURCE = r"""
__device__ __forceinline__ unsigned int mix32(unsigned int x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; return x ^ (x >> 16);
}

extern "C" __global__ void normal_noise_f64(const long long* __restrict__ step, unsigned int stream_key,
                                            double* __restrict__ out, long long n, long long half) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= half) return;
    const unsigned long long s = (unsigned long long)step[0];
    const unsigned int k1 = mix32(stream_key ^ (unsigned int)s ^ ((unsigned int)(s >> 32) * 0x27D4EB2Fu));
    const unsigned int k2 = mix32(k1 ^ 0x9E3779B9u);
    const unsigned int k3 = mix32(k2 ^ 0x85EBCA6Bu);
    const unsigned int bits_r = mix32(mix32(mix32((unsigned int)i ^ k1) ^ k2) ^ k3);
    const unsigned int bits_a = mix32(mix32(mix32((unsigned int)(half + i) ^ k1) ^ k2) ^ k3);
    const double scale = 1.0 / 4294967296.0;
    const double radius = sqrt(-2.0 * log(1.0 - (double)bits_r * scale));
    const double angle = 6.283185307179586 * ((double)bits_a * scale);
    out[i] = radius * cos(angle);
    if (half + i < n) out[half + i] = radius * sin(angle);
}
"""

_KERNELS = SourceKernels(NORMAL_NOISE_SOURCE, ["normal_noise_f64"], "normal_noise")


def normal_noise_cuda(stream_key: int, step: Tensor, n: int, device: torch.device) -> Tensor:
    """``n`` standard normal float64 draws on a CUDA ``device`` for a stream's 32-bit key and the step (an int64
    scalar tensor, read on the device: capture-safe, no host read); 0 < n < 2^32."""
    half = (n + 1) // 2
    out = torch.empty(2 * half, dtype=torch.float64, device=device)
    step = step.to(device=device, dtype=torch.int64).reshape(1).contiguous()
    threads = 128
    _KERNELS.get("normal_noise_f64", device).launch(
        (-(-half // threads),), (threads,), [step, np.uint32(stream_key), out, np.int64(n), np.int64(half)])
    return out[:n]


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


def stream_key(seed: int, stream: int) -> int:
    return _mix((_mix(seed & _M32) ^ _mix((seed >> 32) & _M32 ^ 0x68E31DA4) ^ _mix(stream + 1)) & _M32)


def hashed_bits(key: int | Tensor, step: Tensor, index: Tensor) -> Tensor:
    """The hashed 32-bit words (int64 in [0, 2^32)) at draw ``index`` of the stream ``key`` (``stream_key`` of
    (seed, stream); a tensor: one key per index) for ``step``."""
    step = step.to(torch.int64)
    k1 = _mix(key ^ (step & _M32) ^ (((step >> 32) * 0x27D4EB2F) & _M32))
    k2 = _mix(k1 ^ 0x9E3779B9)  # independent round keys: no related-key structure between the rounds
    k3 = _mix(k2 ^ 0x85EBCA6B)
    return _mix(_mix(_mix(index ^ k1) ^ k2) ^ k3)


def uniform_bits(seed: int, step: Tensor, stream: int, n: int, device: torch.device | str) -> Tensor:
    """``n`` hashed 32-bit words (int64 in [0, 2^32)) for (seed, step, stream)."""
    return hashed_bits(stream_key(int(seed), int(stream)), step, torch.arange(n, dtype=torch.int64, device=device))


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
        return normal_noise_cuda(stream_key(int(seed), int(stream)), step, n, device)
    return normal_noise_reference(seed, step, stream, n, device)


def normal_noise_reference(seed: int, step: Tensor, stream: int, n: int, device: torch.device | str) -> Tensor:
    """``normal_noise`` as torch operations on any device (the CPU path, and the CUDA kernel's reference)."""
    half = (n + 1) // 2
    bits = uniform_bits(seed, step, stream, 2 * half, device)
    radius, angle = polar(bits[:half], bits[half:])
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:n]  # both Box-Muller outputs
