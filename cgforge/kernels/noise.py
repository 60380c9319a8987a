"""The MD engine's counter-based Gaussian noise as one CUDA kernel: the same draws as the torch expression in
``cgforge.plugin.md.noise`` (which owns the hash, its reference and the statistics' tests).

The torch expression is ~60 tiny kernels per call, and inside the engine's CUDA graph each costs a few
microseconds however little it does (an NPT step draws three times). uint32 arithmetic wraps as the int64
expression's low 32 bits do; one thread makes a Box-Muller pair.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .core.registry import SourceKernels

__all__ = ["NORMAL_NOISE_SOURCE", "normal_noise_cuda"]

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
