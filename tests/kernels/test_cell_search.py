"""The cell-list search's candidate loop as CUDA kernels (cgforge.kernels.cell_search): the source compiles (NVRTC,
no GPU needed) and runs on the CPU as C++ (``host_cuda``) equal to the torch loop it replaces on a GPU (the same
pairs in the same order), on periodic, small and skewed cells with many images, mixed and no periodicity, atoms
outside the cell, one atom and a water box; on a GPU the whole search equals the torch one and matscipy."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from ase import Atoms
from host_cuda import assert_compiles_without_spills, build, call

from cgforge.kernels import cell_search
from cgforge.kernels.cell_search import CELL_SEARCH_SOURCE
from cgforge.kernels.edge_layout import edges_within
from cgforge.plugin.runtime import neighbours
from cgforge.plugin.water import water_box

SKEWED = [[6.0, 0.0, 0.0], [2.5, 5.5, 0.0], [-1.8, 1.2, 6.3]]
VERY_SKEWED = [[4.0, 0.0, 0.0], [3.6, 1.9, 0.0], [3.1, 1.2, 2.2]]


def _atoms(n, cell, pbc, seed, low=0.0, high=1.0) -> Atoms:
    rng = np.random.default_rng(seed)
    cell = np.asarray(cell, dtype=float)
    cell = np.diag(cell) if cell.ndim == 1 else cell
    return Atoms(f"H{n}", positions=rng.uniform(low, high, (n, 3)) @ cell, cell=cell, pbc=pbc)


CASES = {  # name: (atoms, cutoff)
    "periodic": (_atoms(200, [14.0, 9.0, 20.0], True, 1), 4.5),
    "one-bin": (_atoms(40, [7.0, 7.0, 7.0], True, 2), 5.0),
    "very-skewed": (_atoms(30, VERY_SKEWED, True, 4), 3.0),
    "many-images": (_atoms(4, np.asarray(SKEWED) * 0.35, True, 5), 4.0),
    "one-atom": (Atoms("H", positions=[[0.3, 0.2, 0.1]], cell=[1.0, 1.3, 1.6], pbc=True), 2.5),
    "pbc-TFT-outside": (_atoms(50, SKEWED, (True, False, True), 6, low=-1.5, high=2.5), 3.2),
    "pbc-FTF-outside": (_atoms(50, SKEWED, (False, True, False), 6, low=-1.5, high=2.5), 3.2),
    "no-pbc": (_atoms(80, [9.0, 8.0, 10.0], False, 7, low=-0.5, high=1.5), 3.0),
    "water": (water_box(27, seed=1), 6.0),
}

_DRIVER = r"""
extern "C" void pairs_SUFFIX(const T* sorted_pos, const long long* atoms_by_bin, const long long* coord,
        const long long* first_in_bin, const long long* atoms_in_bin, const T* cell, const long long* wrap,
        long long b0, long long b1, long long b2, int r0, int r1, int r2, int p0, int p1, int p2, T cutoff2,
        long long n, const long long* rowptr, long long* count, long long* sender, long long* shifts) {
    run_warps((int)n, [&] {  // a warp per receiver
        cell_pairs_SUFFIX(sorted_pos, atoms_by_bin, coord, first_in_bin, atoms_in_bin, cell, wrap, b0, b1, b2, r0,
                          r1, r2, p0, p1, p2, cutoff2, n, rowptr, count, sender, shifts);
    });
}
"""


def test_kernels_compile_without_spills() -> None:
    assert_compiles_without_spills(CELL_SEARCH_SOURCE, "cell_search.cu", ["cell_pairs_f32", "cell_pairs_f64"])


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cell_search")
    out = {}
    for dtype, scalar, suffix in ((torch.float64, "double", "f64"), (torch.float32, "float", "f32")):
        driver = f"typedef {scalar} T;\n" + _DRIVER.replace("SUFFIX", suffix)
        out[dtype] = (build(CELL_SEARCH_SOURCE, driver, folder, f"cell_search_{suffix}"), suffix)
    return out


def _inputs(atoms: Atoms, cutoff: float, dtype: torch.dtype, device: str = "cpu"):
    positions = torch.tensor(atoms.positions, dtype=dtype, device=device)
    cell = torch.tensor(atoms.cell.array, dtype=dtype, device=device)
    pbc = tuple(bool(p) for p in atoms.pbc)
    return positions, cell, pbc, neighbours._bin_atoms(positions, cell, pbc, cutoff)


def _host_pairs(library, suffix: str, binned, cell: torch.Tensor, pbc) -> tuple[torch.Tensor, ...]:
    """``cell_pairs_cuda`` with its kernel run as C++."""
    dtype = binned.wrapped.dtype
    scalar = ctypes.c_double if dtype == torch.float64 else ctypes.c_float
    n = binned.wrapped.shape[0]
    sorted_pos = binned.wrapped.index_select(0, binned.atoms_by_bin).contiguous().numpy()
    head = [sorted_pos, binned.atoms_by_bin.numpy(), binned.coord.contiguous().numpy(),
            binned.first_in_bin.numpy(), binned.atoms_in_bin.numpy(), cell.contiguous().numpy(),
            binned.wrap.contiguous().numpy(), *binned.bins, *(ctypes.c_int(r) for r in binned.reach),
            *(ctypes.c_int(int(p)) for p in pbc), scalar(binned.search_cutoff ** 2), n]
    function = getattr(library, f"pairs_{suffix}")
    counts = np.zeros(n, np.int64)
    call(function, [*head, None, counts, None, None])
    rowptr = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    total = int(counts.sum())
    sender, shifts = np.full(total, -1, np.int64), np.zeros((total, 3), np.int64)
    call(function, [*head, rowptr, counts, sender, shifts])
    receiver = torch.from_numpy(np.repeat(np.arange(n, dtype=np.int64), counts))
    sender, shifts = torch.from_numpy(sender), torch.from_numpy(shifts)
    order = torch.argsort(receiver * n + sender, stable=True)
    return sender[order], receiver, shifts[order]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", [  # the 200-atom box: 3-7 s a dtype on 2 cores
    pytest.param(c, marks=pytest.mark.slow) if c == "periodic" else c for c in CASES])
def test_cuda_source_run_as_cpp_equals_the_torch_loop(libraries, case, dtype) -> None:
    atoms, cutoff = CASES[case]
    library, suffix = libraries[dtype]
    _, cell, pbc, binned = _inputs(atoms, cutoff, dtype)
    got = _host_pairs(library, suffix, binned, cell, pbc)
    want = cell_search.candidate_pairs_reference(binned, cell, pbc, 1 << 22)
    assert want[0].numel() > 0
    for name, a, b in zip(("sender", "receiver", "shifts"), got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_kernel_search_equals_the_torch_search_and_matscipy(case, dtype) -> None:
    from matscipy.neighbours import neighbour_list as matscipy_list

    atoms, cutoff = CASES[case]
    positions, cell, pbc, binned = _inputs(atoms, cutoff, dtype, "cuda")
    kernel = cell_search.candidate_pairs(binned, cell, pbc, 1 << 22)
    loop = cell_search.candidate_pairs_reference(binned, cell, pbc, 1 << 22)

    def cut(pairs):  # the search's exact cut (candidates within rounding of the search cutoff may differ)
        inside = edges_within(positions, cell, *pairs, cutoff)[2]
        return [t[inside] for t in pairs]

    kernel, loop = cut(kernel), cut(loop)
    search = neighbours._search(positions, cell, pbc, cutoff, 1 << 22)  # takes the kernels on a GPU
    for a, b, c in zip(kernel, loop, search, strict=True):
        assert a.is_cuda and torch.equal(a, b) and torch.equal(a, c), "the same list in the same order"
    if dtype == torch.float64:
        i, j, s = matscipy_list("ijS", atoms, cutoff)
        rows = {tuple(r) for r in np.column_stack([i, j, s]).tolist()}
        got = np.column_stack([t.cpu().numpy().reshape(len(kernel[0]), -1) for t in kernel])
        assert len(got) == len(rows) and {tuple(r) for r in got.tolist()} == rows
