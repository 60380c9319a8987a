"""Radial tables in patched NequIP models: every block's edge MLP read from a table of the normalised edge length
(cgforge/patches/nequip/radial_table.py) gives the MLP's energies and forces, leaves the state_dict alone, turns
off and unpatches cleanly, composes with streaming, and is refused with a reason where it cannot apply.
Conservation of a tabulated NequIP model: tests/test_conservation.py ("nequip-l2-tables")."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("nequip")

from global_state import nequip_global_state  # noqa: E402

from cgforge.patches import nequip as pn  # noqa: E402
from cgforge.patches.nequip import radial_table as rt  # noqa: E402
from cgforge.plugin.calculator import Calculator  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402

R_MAX = 3.0


def _model(dtype: str = "float64", **kwargs) -> torch.nn.Module:
    """A small random NequIP GraphModel (H, O; 2 layers, l_max 2), built in-process, unpatched."""
    from nequip.model import NequIPGNNModel

    with nequip_global_state():
        return NequIPGNNModel(
            seed=1, model_dtype=dtype, type_names=["H", "O"], r_max=R_MAX, avg_num_neighbors=10.0,
            per_type_energy_shifts={"H": -1.0, "O": -2.0}, per_type_energy_scales={"H": 1.0, "O": 1.5},
            num_layers=2, l_max=2, parity=True, num_features=4, radial_mlp_depth=1, radial_mlp_width=8, **kwargs,
        ).eval()


def _calculator(model: torch.nn.Module, **kw) -> Calculator:
    return Calculator(copy.deepcopy(model), device=kw.pop("device", "cpu"), patch=kw.pop("patch", True), **kw)


def _energy_forces(calc: Calculator, atoms) -> tuple[float, np.ndarray]:
    """Computed now: ASE would hand back the results of the last call for the same structure."""
    calc.reset()
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms.get_potential_energy(), atoms.get_forces()


def _assert_tables_match_the_mlp(model: torch.nn.Module, atoms) -> None:
    reference = _calculator(model, radial_table=False)
    tabulated = _calculator(model, radial_table=True)
    assert not reference.radial_table and tabulated.radial_table
    assert tabulated.inert_edges_reason is None and reference.inert_edges_reason is None  # tables looked through
    assert len(tabulated.radial_table_errors) == 2 and all(e <= 1e-7 for _, e in tabulated.radial_table_errors)
    e0, f0 = _energy_forces(reference, atoms)
    e1, f1 = _energy_forces(tabulated, atoms)
    assert np.abs(f0).max() > 1e-3  # forces to compare
    assert abs(e1 - e0) <= 1e-9 * abs(e0)
    assert np.abs(f1 - f0).max() <= 1e-6 * np.abs(f0).max()
    assert abs(e1 - e0) > 0 or np.abs(f1 - f0).max() > 0  # the table is not the MLP: the check is not vacuous
    # the state_dict is the same (tables are non-persistent buffers; the stand-ins adopt the originals' modules)
    sd0, sd1 = reference.model.state_dict(), tabulated.model.state_dict()
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)


def test_nequip_with_tables_matches_the_mlp() -> None:
    torch.set_default_dtype(torch.float64)
    _assert_tables_match_the_mlp(_model(), water_box(24, seed=5))


def test_nequip_tables_with_per_edge_type_cutoffs() -> None:
    """The table's variable is x = r / r_max of the edge's type pair: with per-edge-type cutoffs the weights are a
    function of x, not of r, and edges with x >= 1 (inside the global r_max) read the table's end value (~0)."""
    torch.set_default_dtype(torch.float64)
    model = _model(per_edge_type_cutoff={"H": 2.2, "O": {"H": 2.2, "O": 3.0}})
    _assert_tables_match_the_mlp(model, water_box(24, seed=7))


def test_nequip_tables_are_read_inside_the_convolution() -> None:
    """Patched, the blocks' convolutions read the tables inside their kernels (TableWeights, no [E, weight_numel]
    weights): the same energy and forces as the tables evaluated first (FP64). Second derivatives of the fused path:
    tests/test_conservation.py ("nequip-l2-tables": force-Jacobian symmetry, finite differences, NVE drift)."""
    torch.set_default_dtype(torch.float64)
    atoms = water_box(16, seed=9)
    atoms.rattle(0.05, seed=10)
    calc = _calculator(_model(), radial_table=True)
    tables = rt.radial_tables(calc.model)
    assert len(tables) == 2 and all(t.fused for t in tables)
    fused = calc.model.state_dict()
    seq = calc.adapter.energy_model
    seen = []
    hook = seq.layer0_convnet.conv.tp_scatter.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(type(kwargs["edge_weight"]).__name__), with_kwargs=True)
    e_fused, f_fused = _energy_forces(calc, atoms)
    hook.remove()
    assert seen == ["TableWeights"]
    rt.set_table_fusion(calc.model, False)
    assert not any(t.fused for t in tables)
    calc.step.invalidate()
    e_plain, f_plain = _energy_forces(calc, atoms)
    assert abs(e_fused - e_plain) <= 1e-12 * abs(e_plain)
    assert np.abs(f_fused - f_plain).max() <= 1e-11 * np.abs(f_plain).max()
    assert calc.model.state_dict().keys() == fused.keys()


def test_nequip_tables_off_and_unpatch_restore_the_model() -> None:
    torch.set_default_dtype(torch.float64)
    atoms = water_box(8, seed=6)
    calc = _calculator(_model(), radial_table=False)
    e0, f0 = _energy_forces(calc, atoms)
    seq = calc.adapter.energy_model
    encoding, factor, mlp = seq.bessel_encode, seq.factor, seq.layer0_convnet.conv.edge_mlp
    assert pn.set_radial_table(calc.model, True) == 2 and len(rt.radial_tables(calc.model)) == 2
    assert type(seq.bessel_encode).__name__ == "NormLengthAsEmbedding" and type(seq.factor).__name__ == "FactorInTable"
    assert pn.set_radial_table(calc.model, True) == 2  # already on: the same tables
    pn.set_radial_table(calc.model, False)
    calc.step.invalidate()
    assert not rt.radial_tables(calc.model)
    assert seq.bessel_encode is encoding and seq.factor is factor and seq.layer0_convnet.conv.edge_mlp is mlp
    e1, f1 = _energy_forces(calc, atoms)
    assert e1 == e0 and np.array_equal(f1, f0)
    pn.set_radial_table(calc.model, True)
    calc.adapter.set_streaming(1 << 20)  # unpatch takes streaming and tables off together
    pn.unpatch(calc.model)
    assert not pn.is_patched(calc.model)
    assert not any(type(m).__module__.startswith("cgforge") for m in calc.model.modules())


def test_nequip_tables_stream() -> None:
    """Streaming edges over a tabulated model, tables turned on and off while streaming: the same numbers."""
    torch.set_default_dtype(torch.float64)
    atoms = water_box(16, seed=8)
    calc = _calculator(_model(), radial_table=True)
    e0, f0 = _energy_forces(calc, atoms)

    def again() -> tuple[float, np.ndarray]:
        calc.step.invalidate()
        return _energy_forces(calc, atoms)

    assert calc.adapter.set_streaming(1 << 20) == 2
    blocks = [calc.adapter.energy_model.layer0_convnet.conv, calc.adapter.energy_model.layer1_convnet.conv]
    assert all(type(b.edge_mlp).__name__ == "DeferredRadial" for b in blocks)
    assert len(calc.adapter.set_radial_table(True)) == 2  # the streaming blocks' tables are found
    e1, f1 = again()
    assert calc.adapter.set_radial_table(False) == []  # off while streaming: the MLPs stream again
    assert all(type(b.edge_mlp.mlp).__name__ == "ScalarMLPFunction" for b in blocks)
    e_mlp, f_mlp = again()
    assert len(calc.adapter.set_radial_table(True)) == 2  # on while streaming
    assert all(isinstance(b.edge_mlp.mlp, rt.TabulatedRadial) for b in blocks)
    assert blocks[0].tp_scatter.chunk_edges == blocks[1].tp_scatter.chunk_edges is not None
    e2, f2 = again()
    calc.adapter.set_streaming(None)
    e3, f3 = again()
    assert all(isinstance(b.edge_mlp, rt.TabulatedRadial) for b in blocks)
    for e, f in ((e1, f1), (e2, f2), (e3, f3)):
        assert abs(e - e0) <= 1e-10 * abs(e0) and np.abs(f - f0).max() <= 1e-10
    assert abs(e_mlp - e0) <= 1e-9 * abs(e0) and np.abs(f_mlp - f0).max() <= 1e-6 * np.abs(f0).max()


def test_nequip_tables_refused_with_a_reason() -> None:
    torch.set_default_dtype(torch.float64)
    plain = _model()
    assert "not patched by cgforge" in rt.why_not_tabulated(plain)
    with pytest.raises(ValueError, match="radial tables: .*not patched by cgforge"):
        rt.set_radial_table(plain, True)
    assert "one SequentialGraphNetwork, found 0" in rt.why_not_tabulated(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="radial_table=True, patch=False: the radial tables are read by cgforge's"):
        _calculator(plain, patch=False, radial_table=True)
    # a module cgforge has not read, or one configured to read the edge embedding, in the network
    patched = pn.patch(copy.deepcopy(plain))
    seq = patched.model.func
    seq.add_module("extra", torch.nn.Identity())
    assert rt.why_not_tabulated(patched) == "extra (Identity) is not a module cgforge has checked"
    del seq.extra
    assert rt.why_not_tabulated(patched) is None
    seq.per_atom_energy_readout.field = "edge_embedding"
    assert "per_atom_energy_readout (ScalarMLP) reads or writes the edge embedding" in rt.why_not_tabulated(patched)


def _assert_fp32_close(mlp: Calculator, tabulated: Calculator, atoms) -> None:
    """FP32 agreement of the bundled model with and without tables. Its per-atom energies (about +-3 eV) nearly
    cancel in the total (3.6 eV for 192 atoms), and the ~1e-7 relative errors of W (the FP32 MLP's rounding is
    larger than the table's) repeat coherently over the box's identical O-H bonds: the energy is compared with
    the sum of the per-atom energies' magnitudes (CPU, 192 atoms: 7e-8 of it, but 1e-5 of the total itself)."""
    e0, f0 = _energy_forces(mlp, atoms)
    e1, f1 = _energy_forces(tabulated, atoms)
    atoms = atoms.copy()
    atoms.calc = mlp
    scale = np.abs(atoms.get_potential_energies()).sum()
    assert abs(e1 - e0) <= 1e-6 * scale
    assert np.abs(f1 - f0).max() <= 1e-4 * np.abs(f0).max()


@pytest.mark.slow
def test_calculator_tables_on_the_bundled_model() -> None:
    """The bundled FP32 model (a package: its own class copies) with tables equals it without, to FP32 precision;
    on a CPU tables are on only when asked for."""
    torch.set_default_dtype(torch.float64)
    atoms = water_box(32, seed=3)
    mlp = Calculator("nequip", device="cpu", patch=True, radial_table=False)
    tabulated = Calculator("nequip", device="cpu", patch=True, radial_table=True)
    assert not Calculator("nequip", device="cpu", patch=True, warmup=False).radial_table  # auto: CUDA only
    assert tabulated.radial_table and all(e <= 1e-7 for _, e in tabulated.radial_table_errors)
    _assert_fp32_close(mlp, tabulated, atoms)
    sd0, sd1 = mlp.model.state_dict(), tabulated.model.state_dict()
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)


@pytest.mark.cuda
def test_cuda_bundled_nequip_tables_match_the_mlp_in_fp32() -> None:
    torch.set_default_dtype(torch.float32)
    atoms = water_box(64, seed=9)
    auto = Calculator("nequip", device="cuda", patch=True)  # FP32 on CUDA: tables by default, read in the kernels
    mlp = Calculator("nequip", device="cuda", patch=True, radial_table=False)
    assert auto.radial_table and not mlp.radial_table
    assert all(t.fused for t in rt.radial_tables(auto.model))
    _assert_fp32_close(mlp, auto, atoms)
