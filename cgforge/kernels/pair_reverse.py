"""The reverse of every pair of a neighbour list, as one CUDA kernel: a thread per pair, a binary search in a row.

Input: ``V`` pairs (sender s, receiver r, integer image shifts S [V, 3]) sorted by (receiver, sender), with
``rowptr`` [N + 1] their receiver rows. The reverse of (s -> r, S) is (r -> s, -S), in row s:

    reverse[v] = that pair's index,    or v and missing = 1 when the list lacks it

``pair_reverse_reference`` (a sort and host reads) is the reference and the CPU path; ``pair_reverse`` picks one.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .core.launch import thread_blocks
from .core.registry import SourceKernels

__all__ = ["PAIR_REVERSE_SOURCE", "pair_reverse", "pair_reverse_cuda", "pair_reverse_reference"]

PAIR_REVERSE_SOURCE = r"""
extern "C" __global__ void pair_reverse(const long long* __restrict__ sender, const long long* __restrict__ receiver,
                                        const long long* __restrict__ shifts, const long long* __restrict__ rowptr,
                                        long long pairs, long long* __restrict__ reverse, int* __restrict__ missing) {
    const long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= pairs) return;
    const long long s = sender[v], r = receiver[v];
    const long long a = -shifts[3 * v], b = -shifts[3 * v + 1], c = -shifts[3 * v + 2];
    long long lo = rowptr[s], hi = rowptr[s + 1];
    const long long end = hi;
    while (lo < hi) {  // the first pair of row s whose sender is >= r
        const long long mid = lo + (hi - lo) / 2;
        if (sender[mid] < r) lo = mid + 1; else hi = mid;
    }
    long long found = -1;
    for (long long k = lo; k < end && sender[k] == r; ++k) {
        if (shifts[3 * k] == a && shifts[3 * k + 1] == b && shifts[3 * k + 2] == c) { found = k; break; }
    }
    if (found < 0) {
        found = v;
        *missing = 1;  // every writer writes 1: no race on the value
    }
    reverse[v] = found;
}
"""

_KERNELS = SourceKernels(PAIR_REVERSE_SOURCE, ["pair_reverse"], "pair_reverse")
_THREADS = 256


def pair_reverse_cuda(sender: Tensor, receiver: Tensor, shifts: Tensor, rowptr: Tensor) -> tuple[Tensor, Tensor]:
    """(reverse int64 [V], missing int32 [1]) of the module doc, on the pairs' CUDA device; reads nothing back to
    the host. sender, receiver [V], shifts [V, 3], rowptr [N + 1]: int64, sorted by (receiver, sender)."""
    device = sender.device
    if not sender.is_cuda:
        raise ValueError(f"pair_reverse_cuda: the pairs must be on a CUDA device, got {device}")
    pairs = sender.shape[0]
    for name, t, shape in (("sender", sender, (pairs,)), ("receiver", receiver, (pairs,)),
                           ("shifts", shifts, (pairs, 3)), ("rowptr", rowptr, (rowptr.shape[0],))):
        if t.dtype != torch.int64 or t.device != device or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"pair_reverse_cuda: {name} must be a contiguous int64 tensor of shape {shape} on "
                             f"{device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    reverse = torch.empty(pairs, dtype=torch.int64, device=device)
    missing = torch.zeros(1, dtype=torch.int32, device=device)
    if pairs:
        _KERNELS.get("pair_reverse", device).launch(
            (thread_blocks(pairs, _THREADS),), (_THREADS,),
            [sender, receiver, shifts, rowptr, np.int64(pairs), reverse, missing])
    return reverse, missing


def pair_reverse(sender: Tensor, receiver: Tensor, shifts: Tensor, rowptr: Tensor) -> Tensor | None:
    """reverse int64 [V] of the module doc for V >= 1 pairs sorted by (receiver, sender) with integer image shifts
    [V, 3] and receiver rows ``rowptr`` [N + 1]; None when a pair has no reverse."""
    if sender.is_cuda:
        found, missing = pair_reverse_cuda(sender.contiguous(), receiver.contiguous(),
                                           shifts.to(torch.int64).contiguous(), rowptr)
        return None if bool(missing[0]) else found
    return pair_reverse_reference(sender, receiver, shifts, rowptr.shape[0] - 1)


def pair_reverse_reference(sender: Tensor, receiver: Tensor, shifts: Tensor, num_nodes: int) -> Tensor | None:
    """``pair_reverse`` by a sort of int64 keys (receiver, sender, shift) and a search of each pair's reverse key,
    with host reads; None when a pair has no reverse, or the keys would overflow."""
    n, count = int(num_nodes), int(sender.shape[0])
    reach = int(shifts.abs().max())
    side = 2 * reach + 1
    if n * n * side**3 >= 2**62:  # the keys below would overflow
        return None

    def key(s: Tensor, r: Tensor, image: Tensor) -> Tensor:
        code = ((image[:, 0] + reach) * side + image[:, 1] + reach) * side + image[:, 2] + reach
        return (r * n + s) * side**3 + code

    shifts = shifts.to(torch.int64)
    keys = key(sender, receiver, shifts)
    order = torch.argsort(keys)
    sorted_keys = keys.index_select(0, order)
    wanted = key(receiver, sender, -shifts)
    where = torch.searchsorted(sorted_keys, wanted).clamp(max=count - 1)
    if not bool((sorted_keys.index_select(0, where) == wanted).all()):
        return None
    return order.index_select(0, where)
