"""What a correct kernel, patch or potential must satisfy, written once for every test that checks it.

- Convolution vs e3nn: `e3nn_conv` is the definition of the fused convolution (e3nn's tensor product of each
  edge, summed into the edge's receiver).
- Equivariance: `random_rotation` (proper or improper), `wigner_d` / `rotate` (features turned by e3nn's D
  matrices, `Irreps.D_from_matrix`), `rotated` (a structure turned, cell included).
- Forces as gradients: `central_difference` (2nd or 4th order), `displaced` (positions moved along a
  direction), `strained` / `stress_by_finite_differences` (sigma = (1/V) dE/d strain), `jacobian_rows` and
  `projected_jacobian` (the force Jacobian dF/dx by autograd, which must be symmetric).
The tolerances stay with the tests: each states what its system's rounding and truncation allow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from ase import Atoms

# ---------------------------------------------------------------------------------------------
# Convolution vs e3nn


def e3nn_conv(tp, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, sender: torch.Tensor, receiver: torch.Tensor,
              n: int) -> torch.Tensor:
    """out[i] = sum over the edges e with receiver[e] = i of tp(x[sender[e]], y[e], w[e]) (w: per edge or shared)."""
    return torch.zeros(n, tp.irreps_out.dim, dtype=x.dtype, device=x.device).index_add(0, receiver, tp(x[sender], y, w))


# ---------------------------------------------------------------------------------------------
# Equivariance


def random_rotation(seed: int, inversion: bool = False) -> torch.Tensor:
    """A Haar-random proper rotation (FP64, CPU) from a seeded generator, times -1 for an improper one."""
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    if torch.det(q) < 0:
        q = -q
    return -q if inversion else q


def wigner_d(irreps, rot: torch.Tensor) -> torch.Tensor:
    """e3nn's D matrix of `irreps` for `rot`, in FP64 (e3nn builds its generators in the default dtype)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return irreps.D_from_matrix(rot.double().cpu())
    finally:
        torch.set_default_dtype(previous)


def rotate(t: torch.Tensor, irreps, rot: torch.Tensor) -> torch.Tensor:
    """Features `t` (rows of `irreps`) turned by `rot`: t D^T."""
    return t @ wigner_d(irreps, rot).to(dtype=t.dtype, device=t.device).T


def rotated(atoms: Atoms, rot: np.ndarray) -> Atoms:
    """Positions rotated by `rot`; the cell by its proper part (inverting every lattice vector gives the
    same lattice, so an inverted crystal keeps a right-handed cell)."""
    proper = rot * np.sign(np.linalg.det(rot))
    out = atoms.copy()
    out.set_cell(np.asarray(atoms.cell) @ proper.T, scale_atoms=False)
    out.positions = atoms.positions @ rot.T
    return out


# ---------------------------------------------------------------------------------------------
# Forces as gradients


def central_difference(f: Callable[[float], object], h: float, order: int = 2):
    """d/dt f(t) at t = 0 by central differences of step h: order 2 (error ~h^2) or 4 (~h^4).

    f returns a float or an array (then the derivative is the array's)."""
    if order == 2:
        return (f(h) - f(-h)) / (2 * h)
    if order == 4:
        return (-f(2 * h) + 8 * f(h) - 8 * f(-h) + f(-2 * h)) / (12 * h)
    raise ValueError(f"order: 2 or 4, got {order}")


def displaced(atoms: Atoms, direction: np.ndarray, t: float) -> Atoms:
    """A copy of `atoms` (no calculator) with positions + t * direction."""
    out = atoms.copy()
    out.positions = atoms.positions + t * direction
    return out


def unit(shape: Sequence[int], atom: int, axis: int) -> np.ndarray:
    """The direction of one coordinate: zeros of `shape` with a 1 at (atom, axis)."""
    d = np.zeros(shape)
    d[atom, axis] = 1.0
    return d


VOIGT = [(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]  # ASE's order: xx yy zz yz xz xy


def strained(atoms: Atoms, strain: np.ndarray) -> Atoms:
    """A copy of `atoms` (no calculator) with cell and positions deformed by I + strain."""
    a = atoms.copy()
    deform = np.eye(3) + strain
    a.set_cell(np.array(a.cell) @ deform, scale_atoms=False)
    a.positions = a.positions @ deform
    return a


def stress_by_finite_differences(energy: Callable[[Atoms], float], atoms: Atoms, h: float = 1e-5) -> np.ndarray:
    """sigma_ij = (1/V) dE/d eps_ij for a symmetric strain of size h, in ASE's Voigt order; V: atoms.cell's
    volume. `energy(atoms)` is the potential energy of a structure."""
    out = []
    for i, j in VOIGT:
        strain = np.zeros((3, 3))
        strain[i, j] = strain[j, i] = h / (1 if i == j else 2)
        de = energy(strained(atoms, strain)) - energy(strained(atoms, -strain))
        out.append(de / (2 * h) / atoms.get_volume())
    return np.array(out)


def jacobian_rows(outputs: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """d outputs / d inputs by autograd, one row per output entry (outputs need a graph to `inputs`)."""
    rows = [torch.autograd.grad(f, inputs, retain_graph=True)[0].reshape(-1) for f in outputs.reshape(-1)]
    return torch.stack(rows)


def projected_jacobian(forces: torch.Tensor, positions: torch.Tensor, vectors: torch.Tensor):
    """For the force Jacobian J = dF/dx (by the double backward): (M, J^T v) with M[j, k] = v_j . J^T v_k.
    A conservative force field has a symmetric J, so M must be symmetric."""
    jt_v = torch.stack([torch.autograd.grad((forces * v).sum(), positions, retain_graph=True)[0] for v in vectors])
    m = torch.einsum("jad,kad->jk", vectors, jt_v)
    return m, jt_v


# ---------------------------------------------------------------------------------------------
# CUDA graphs


def replayed(fn: Callable[[], torch.Tensor], refill: torch.Tensor) -> torch.Tensor:
    """``fn()`` captured in a CUDA graph (after one call outside it, which compiles and loads), ``refill`` then
    given new standard-normal values in place, and the graph replayed: the captured output, which must now be
    ``fn``'s for the new values."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    refill.copy_(torch.randn_like(refill))
    graph.replay()
    torch.cuda.synchronize()
    return out
