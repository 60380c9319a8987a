"""How many blocks of a kernel one SM holds, and when a launch bound raises that number.

``__launch_bounds__(T, B)`` asks ptxas for at most 65536 / (B T) registers. That helps only where registers limit
the blocks; below the budget ptxas fills it instead. So the kernel is compiled once unbounded, and a bound is
proposed only where registers (not shared memory or the warp limit) hold it under 30 % of the SM's warps: B = the
fewest blocks that reach 30 %, then fewer down to one more than now; the caller keeps a bounded compile only where
it uses fewer registers, reaches B blocks and spills at most ``MAX_BOUND_SPILL_BYTES`` more.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .compiler import KernelResources

# Measured (docs/measured-constants.md): only kernels below this fraction of the SM's warps are bounded; the spill
# traffic (stores + loads, bytes per thread) a bounded compile may add to the unbounded one's.
MAX_BOUNDED_OCCUPANCY = 0.3
MAX_BOUND_SPILL_BYTES = 128


@dataclass(frozen=True)
class SMLimits:
    """One streaming multiprocessor's resources (CUDA programming guide, compute capability tables)."""

    registers: int = 65536
    max_warps: int = 64
    max_blocks: int = 32
    shared_memory: int = 228 * 1024  # bytes, of which a block may use at most 227 KB
    reserved_shared_per_block: int = 1024  # what the driver keeps per resident block (sm_80 and later)
    register_unit: int = 256  # registers are allocated per warp in units of this many

    def blocks(self, threads: int, registers: int | None, shared_bytes: int) -> int:
        """Resident blocks of `threads` threads using `registers` a thread (None: do not count registers) and
        `shared_bytes` of shared memory a block."""
        warps = -(-threads // 32)
        limit = min(self.max_blocks, self.max_warps // warps,
                    self.shared_memory // (shared_bytes + self.reserved_shared_per_block))
        if registers is not None and registers > 0:
            per_warp = -(-registers * 32 // self.register_unit) * self.register_unit
            limit = min(limit, (self.registers // per_warp) // warps)
        return limit


# By cubin architecture; an architecture not listed gets no launch bound (nothing is guessed).
SM_LIMITS: dict[str, SMLimits] = {"sm_80": SMLimits(shared_memory=164 * 1024),
                                  "sm_86": SMLimits(max_warps=48, max_blocks=16, shared_memory=100 * 1024),
                                  "sm_89": SMLimits(max_warps=48, max_blocks=24, shared_memory=100 * 1024),
                                  "sm_90": SMLimits()}


def sm_limits(arch: str) -> SMLimits | None:
    """The SM of a cubin architecture ('sm_90', 'sm_90a'), or None if unknown."""
    return SM_LIMITS.get(arch.rstrip("af"))


def proposed_min_blocks(sm: SMLimits, threads: int, shared_bytes: int, unbounded: KernelResources) -> tuple[int, ...]:
    """The Bs to try for ``__launch_bounds__(threads, B)``, best first: where the unbounded kernel's registers are
    what stops the SM from holding more of its blocks (not shared memory, not the warp limit) and it holds less
    than ``MAX_BOUNDED_OCCUPANCY`` of the SM's warps, from the fewest blocks that reach that fraction down to one
    more than it gets now; else none (ptxas does not fit a budget monotonically: a larger B may spill less)."""
    now = sm.blocks(threads, unbounded.registers, shared_bytes)
    warps = -(-threads // 32)
    most = sm.blocks(threads, None, shared_bytes)
    if now * warps >= MAX_BOUNDED_OCCUPANCY * sm.max_warps or now >= most:
        return ()
    target = min(most, math.ceil(MAX_BOUNDED_OCCUPANCY * sm.max_warps / warps))
    return tuple(range(target, now, -1))


def accepts_bound(sm: SMLimits, threads: int, shared_bytes: int, unbounded: KernelResources,
                  bounded: KernelResources, min_blocks: int) -> bool:
    """Keep the bounded compile: fewer registers, `min_blocks` resident, little more spill traffic."""
    def spilled(r: KernelResources) -> int:
        return r.spill_stores + r.spill_loads

    return (bounded.registers < unbounded.registers
            and sm.blocks(threads, bounded.registers, shared_bytes) >= min_blocks
            and spilled(bounded) <= spilled(unbounded) + MAX_BOUND_SPILL_BYTES)


def choose_min_blocks(sm: SMLimits | None, threads: int, shared_bytes: int,
                      compile_with: Callable[[int | None], KernelResources]) -> int | None:
    """The launch bound to compile with (None: none): `compile_with(B)` compiles the kernel under
    ``__launch_bounds__(threads, B)`` (None: without B) and returns its ptxas resources; the first proposed B
    whose compile ``accepts_bound`` keeps."""
    if sm is None:
        return None
    unbounded = compile_with(None)
    for proposed in proposed_min_blocks(sm, threads, shared_bytes, unbounded):
        if accepts_bound(sm, threads, shared_bytes, unbounded, compile_with(proposed), proposed):
            return proposed
    return None
