"""cgforge.plugin.lammps against a stand-in of LAMMPS's ML-IAP data object (built from ASE), and the CLI.

The stand-in (``tests/lammps/lammps_standin.py``) gives each domain its local atoms, ghosts and pairs as LAMMPS
does, adds the pair forces and the virial up as ``update_pair_forces`` does, and exchanges node features
between domains. Energy, per-atom energies, forces and virial must equal ``cgforge.plugin.Calculator`` on
the periodic structure to 1e-10 (FP64), in both modes, on one domain and split into two.
"""

from __future__ import annotations

import copy
import itertools
import pickle
import warnings

import numpy as np
import pytest
import torch
from ase import Atoms
from lammps_standin import HOST_COMM_WIDTH, StandInData, build_domains, combine, run_domains

from cgforge.plugin import Calculator
from cgforge.plugin.cli import main as cli_main
from cgforge.plugin.lammps import CgforgeMLIAP, LammpsSetupError
from cgforge.plugin.lammps.captured import PAIR_MARGIN
from cgforge.plugin.runtime.capture import room
from cgforge.plugin.water import water_box

TOL = 1e-10
R_MAX = 3.0


@pytest.fixture(autouse=True)
def fp64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture(scope="module")
def mace_file(tmp_path_factory) -> str:
    from mace_helpers import build_model

    path = tmp_path_factory.mktemp("lammps") / "tiny.model"
    torch.save(build_model(r_max=R_MAX), path)
    return str(path)


@pytest.fixture(scope="module")
def nequip_file(tmp_path_factory, nequip_state) -> str:
    from nequip.model import NequIPGNNModel

    from cgforge.patches.nequip import save_patched_nequip

    model = NequIPGNNModel(
        seed=1, model_dtype="float64", type_names=["H", "O"], r_max=R_MAX, avg_num_neighbors=10.0,
        per_type_energy_shifts={"H": -1.0, "O": -2.0}, per_type_energy_scales={"H": 1.0, "O": 1.5},
        num_layers=2, l_max=2, parity=True, num_features=4, radial_mlp_depth=1, radial_mlp_width=8,
    ).eval()
    path = tmp_path_factory.mktemp("lammps") / "tiny.nequip.zip"
    return str(save_patched_nequip(model, path))


def structure(seed: int = 5) -> Atoms:
    atoms = water_box(12, seed=seed)  # 36 atoms, a 7.1 Å cube: smaller than the 2 x 3 Å ghost shell
    atoms.rattle(0.05, seed=seed)
    return atoms


def reference(path: str, atoms: Atoms, patch: bool) -> dict:
    a = atoms.copy()
    a.calc = Calculator(path, device="cpu", patch=patch)
    return {"energy": a.get_potential_energy(), "energies": a.get_potential_energies(), "forces": a.get_forces(),
            "virial": -a.get_stress(voigt=False) * a.get_volume()}  # LAMMPS's sign: W = -dE/d strain


def run(obj: CgforgeMLIAP, atoms: Atoms, *, mode: str, n_domains: int, flavour: str | None = None,
        device: str = "cpu", path: str | None = None, lammps: str = "2024") -> tuple[dict, list]:
    """``obj`` on ``n_domains`` stand-in domains: LAMMPS's host couple in ghost mode, its Kokkos couple (the one
    that exchanges) in exchange mode, unless ``flavour`` says otherwise."""
    ghost = mode == "ghost"
    flavour = flavour or ("host" if ghost else "kokkos")
    domains = build_domains(atoms, obj.element_types, obj.cutoff, obj.ghost_cutoff if ghost else obj.cutoff,
                            n_domains=n_domains, ghost_neighbours=ghost, exchange=not ghost, flavour=flavour,
                            device=device, lammps=lammps)
    models = [pickle.loads(pickle.dumps(obj)) for _ in domains]  # one per rank, as LAMMPS loads the file
    run_domains(models, domains)
    assert all(m.last_mode == mode for m in models)
    assert path is None or all(m.last_path == path for m in models), [m.last_path for m in models]
    return combine(domains, len(atoms)), domains


def assert_matches(got: dict, ref: dict, tol: float = TOL) -> None:
    virial = 0.5 * (got["virial"] + got["virial"].T)  # LAMMPS keeps xy, xz, yz of -sum rij (x) fij
    for key, value in (("energy", got["energy"]), ("energies", got["energies"]), ("forces", got["forces"]),
                       ("virial", virial)):
        want = np.asarray(ref[key])
        assert np.linalg.norm(want) > 0
        err = np.linalg.norm(np.asarray(value) - want) / np.linalg.norm(want)
        assert err < tol, f"{key}: relative error {err:.3g}"


@pytest.mark.parametrize("n_domains, mode, kind", [  # the fast tier: both modes, kinds and domain counts, 4 of 8
    pytest.param(*case, marks=pytest.mark.slow)
    if case in {(1, "ghost", "nequip"), (2, "ghost", "nequip"), (2, "exchange", "nequip"), (1, "ghost", "mace")}
    else case for case in itertools.product([1, 2], ["ghost", "exchange"], ["mace", "nequip"])])
def test_matches_calculator(kind, mode, n_domains, request):
    path = request.getfixturevalue(f"{kind}_file")
    obj = CgforgeMLIAP(path, patch=False)
    assert obj.layers == 2 and obj.cutoff == R_MAX and obj.element_types == ["H", "O"]
    atoms = structure()
    got, domains = run(obj, atoms, mode=mode, n_domains=n_domains)
    assert_matches(got, reference(path, atoms, patch=False))
    # exchange mode finds the ghosts' owners (one forward exchange of 3 columns), then, on two domains, sends the
    # features before the second layer forward and their gradients back, on every domain, on the host in blocks that
    # LAMMPS's host buffers hold (the stand-in raises on a wider one); one domain needs no feature exchange
    for d in domains:
        sent = {way: [w for w2, w in d.exchange_log if w2 == way] for way in HOST_COMM_WIDTH}
        if mode == "ghost":
            assert not d.exchange_log
            continue
        assert sent["forward"][0] == 3, sent
        if n_domains == 1:
            assert sent == {"forward": [3], "reverse": []}, sent
            continue
        assert sum(sent["forward"]) - 3 == sum(sent["reverse"]) > HOST_COMM_WIDTH["forward"], sent
        assert all(max(sent[way]) <= HOST_COMM_WIDTH[way] for way in sent)
    if n_domains == 2:
        assert all(d.nlocal < len(atoms) for d in domains)


@pytest.mark.parametrize("kind", ["mace", pytest.param("nequip", marks=pytest.mark.slow)])
def test_ghost_mode_runs_the_listed_atoms_receptive_field(kind, request):
    """Ghost mode's eager call runs the model on the pairs whose centre is within layers - 1 hops of a listed atom
    (and the atoms they touch): fewer than LAMMPS gives on these domains, and the results (the left-out pairs' fij
    zero) still equal the Calculator's."""
    path = request.getfixturevalue(f"{kind}_file")
    obj = CgforgeMLIAP(path, patch=False)
    atoms = structure()
    domains = build_domains(atoms, obj.element_types, obj.cutoff, obj.ghost_cutoff, n_domains=2,
                            ghost_neighbours=True, exchange=False, flavour="host")
    models = [pickle.loads(pickle.dumps(obj)) for _ in domains]
    run_domains(models, domains)
    for model, domain in zip(models, domains):
        assert model.last_path == "eager"
        (atoms_run, pairs_run), (atoms_given, pairs_given) = model.last_field
        assert atoms_given == domain.ntotal > atoms_run >= domain.nlistatoms
        assert pairs_given == domain.npairs > pairs_run > 0
    assert_matches(combine(domains, len(atoms)), reference(path, atoms, patch=False))


def test_receptive_field_of_a_chain():
    """Atoms 0-1-2-3-4 in a line, pairs both ways, atom 0 listed: L layers keep the pairs centred within L - 1 hops
    and the atoms they touch; all of them: nothing to cut."""
    from cgforge.plugin.lammps.receptive import receptive_field

    centre = torch.tensor([0, 1, 1, 2, 2, 3, 3, 4])
    neighbour = torch.tensor([1, 0, 2, 1, 3, 2, 4, 3])
    listed = torch.tensor([0])
    one = receptive_field(centre, neighbour, listed, 5, layers=1)
    assert one.pairs.tolist() == [0] and one.atoms.tolist() == [0, 1]
    assert one.node_of.tolist() == [0, 1, -1, -1, -1]
    two = receptive_field(centre, neighbour, listed, 5, layers=2)
    assert two.pairs.tolist() == [0, 1, 2] and two.atoms.tolist() == [0, 1, 2]
    four = receptive_field(centre, neighbour, listed, 5, layers=4)
    assert four.pairs.tolist() == list(range(7)) and four.atoms.tolist() == list(range(5))
    assert receptive_field(centre, neighbour, listed, 5, layers=5) is None
    # an atom no pair reaches is left out however deep the model; listed atoms stay even without pairs
    assert receptive_field(centre, neighbour, listed, 6, layers=5).atoms.tolist() == list(range(5))
    alone = receptive_field(centre[:0], neighbour[:0], torch.tensor([2]), 5, layers=3)
    assert alone.pairs.numel() == 0 and alone.atoms.tolist() == [2]
    with pytest.raises(ValueError, match="layers"):
        receptive_field(centre, neighbour, listed, 5, layers=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mace", "nequip"])
def test_patched_kernels_exchange_two_domains(kind, request):
    """cgforge's kernels (their CPU path): per-call graphs of LAMMPS's pair list, per-species self-connections."""
    path = request.getfixturevalue(f"{kind}_file")
    atoms = structure(seed=7)
    got, _ = run(CgforgeMLIAP(path, patch=True), atoms, mode="exchange", n_domains=2)
    assert_matches(got, reference(path, atoms, patch=True))


@pytest.mark.parametrize("mode", ["ghost", pytest.param("exchange", marks=pytest.mark.slow)])
def test_kokkos_couple_on_the_host(mace_file, mode):
    """The Kokkos couple of a host build: numpy arrays, eatoms written in place into the array it returns,
    forces through update_pair_forces."""
    atoms = structure(seed=8)
    got, domains = run(CgforgeMLIAP(mace_file, patch=False), atoms, mode=mode, n_domains=2, flavour="kokkos")
    assert all(d.pair_force_calls == 1 and type(d).__module__ == "mliap_unified_couple_kokkos" for d in domains)
    assert_matches(got, reference(mace_file, atoms, patch=False))


@pytest.mark.parametrize("lammps", ["2024", pytest.param("2025", marks=pytest.mark.slow)])
def test_host_couple_of_both_versions(mace_file, lammps):
    """LAMMPS 22 Jul 2025's host couple has update_pair_forces_gpu and forward_exchange too (they raise): it is
    still the host couple (write-only eatoms, update_pair_forces), in ghost mode and never in exchange mode."""
    atoms = structure(seed=16)
    obj = CgforgeMLIAP(mace_file, patch=False)
    got, domains = run(obj, atoms, mode="ghost", n_domains=2, lammps=lammps)
    assert (lammps == "2025") == hasattr(domains[0], "update_pair_forces_gpu")
    assert all(d.pair_force_calls == 1 for d in domains)
    assert_matches(got, reference(mace_file, atoms, patch=False))
    # one cutoff of ghosts without their pairs (`pair_style mliap unified FILE 0` on the host couple): a setup
    # error that says what to do, not the couple's NotImplementedError
    (data,) = build_domains(atoms, obj.element_types, obj.cutoff, obj.cutoff, ghost_neighbours=False, lammps=lammps)
    with pytest.raises(LammpsSetupError, match=r"FILE 1.*forward_exchange \(Kokkos"):
        obj.compute_forces(data)


def test_flavour_is_the_couple_module():
    from cgforge.plugin.lammps.arrays import couple_of, is_device_flavour, to_tensor

    (host,) = build_domains(structure(), ["H", "O"], 3.0, 6.0, lammps="2025")
    (kokkos,) = build_domains(structure(), ["H", "O"], 3.0, 6.0, flavour="kokkos")
    assert not is_device_flavour(host) and is_device_flavour(kokkos)
    assert couple_of(host) == "mliap_unified_couple"
    with pytest.raises(TypeError, match="mliap_unified_couple_kokkos"):
        is_device_flavour(object())

    class Exported:  # a device array seen only through DLPack (as CuPy arrays reach the model)
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def __dlpack__(self, *args, **kwargs):
            return self.t.__dlpack__(*args, **kwargs)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    source = torch.arange(6.0)
    shared = to_tensor(Exported(source))
    shared[0] = 42.0  # the same memory, not a copy
    assert source[0] == 42.0


def test_host_exchange_in_blocks(mace_file, monkeypatch):
    """Features wider than LAMMPS's host comm buffers go in blocks; whole, the stand-in refuses them, as LAMMPS
    would write past its buffers (the heap corruption seen on a Kokkos host build)."""
    import cgforge.plugin.lammps.exchange as exchange

    atoms = structure(seed=17)
    obj = CgforgeMLIAP(mace_file, patch=False)
    monkeypatch.setattr(exchange, "HOST_FORWARD_WIDTH", 10**6)
    with pytest.raises(ValueError, match="write past"):
        run(obj, atoms, mode="exchange", n_domains=2)  # one domain exchanges no features


@pytest.mark.cuda
def test_cuda_kokkos_flavour(mace_file):
    # Ghost-neighbour mode: the stand-in runs exchanging domains in threads, and torch runs every CUDA backward
    # on one worker thread per device, so a reverse exchange inside one domain's backward would wait forever
    # for the other's (it hung on the H100). Real LAMMPS ranks are processes; the exchange is tested on CPU.
    atoms = structure(seed=9)
    got, _ = run(CgforgeMLIAP(mace_file, patch=True), atoms, mode="ghost", n_domains=2, flavour="kokkos",
                 device="cuda")
    # cgforge's kernels on both sides: the model's own code differs by its float32-rounded CG constants (~1e-9)
    assert_matches(got, reference(mace_file, atoms, patch=True))


def test_exchange_is_what_makes_it_right(mace_file):
    """Without the feature exchange the other domain's ghosts' second-layer input is wrong: the energy changes."""
    atoms = structure()
    obj = CgforgeMLIAP(mace_file, patch=False)
    domains = build_domains(atoms, obj.element_types, obj.cutoff, obj.cutoff, n_domains=2, ghost_neighbours=False,
                            exchange=True, flavour="kokkos")
    models = [copy.deepcopy(obj) for _ in domains]
    for model, data in zip(models, domains):
        model.prepare(data)
        model._hooks.remove()
    run_domains(models, domains)
    got, ref = combine(domains, len(atoms)), reference(mace_file, atoms, patch=False)
    err = np.linalg.norm(got["forces"] - ref["forces"]) / np.linalg.norm(ref["forces"])
    assert err > 1e-5 and abs(got["energy"] - ref["energy"]) > 10 * TOL * abs(ref["energy"]), err


def test_setup_errors(mace_file):
    atoms = structure()
    obj = CgforgeMLIAP(mace_file, patch=False)
    # pairs of local atoms only, no exchange: a 2-layer model cannot be right
    (plain,) = build_domains(atoms, obj.element_types, obj.cutoff, obj.cutoff, ghost_neighbours=False)
    with pytest.raises(LammpsSetupError, match=r"pair_style mliap unified FILE 1.*comm_modify cutoff 6"):
        obj.compute_forces(plain)
    forced = CgforgeMLIAP(mace_file, patch=False, mode="exchange")
    (ghosts,) = build_domains(atoms, obj.element_types, obj.cutoff, obj.ghost_cutoff)
    with pytest.raises(LammpsSetupError, match="forward_exchange"):
        forced.compute_forces(ghosts)
    with pytest.raises(ValueError, match="mode"):
        CgforgeMLIAP(mace_file, mode="both")
    with pytest.raises(FileNotFoundError, match="not found"):
        CgforgeMLIAP(mace_file + ".missing")


def test_pickle_holds_bytes_and_options_only(mace_file):
    obj = CgforgeMLIAP(mace_file, patch=False)
    (data,) = build_domains(structure(), obj.element_types, obj.cutoff, obj.ghost_cutoff)
    obj.compute_forces(data)  # loaded now: the runtime state must not travel
    # the file format: these attributes and no others (files of earlier versions hold a subset: __setstate__)
    assert set(obj.__getstate__()) == {
        "_padded", "cuda_graph", "cutoff", "device", "dtype", "element_types", "head", "inert_edges_reason", "kind",
        "last_mode", "last_path", "layers", "mode", "model_bytes", "model_name", "ndescriptors", "nparams", "patch",
        "radial_table", "rcutfac", "timers", "type_map"}
    blob = pickle.dumps(obj)
    with open(mace_file, "rb") as f:
        size = len(f.read())
    assert len(blob) < size + 4096
    again = pickle.loads(blob)
    assert again._potential is None and again.interface is None and again.rcutfac == 0.5 * R_MAX
    assert again.ndescriptors == 1 and again.nparams == 1


@pytest.mark.slow
def test_cli_writes_a_loadable_file(mace_file, tmp_path, capsys):
    out = tmp_path / "tiny.mliap.pkl"
    assert cli_main(["lammps-model", mace_file, str(out), "--patch", "off"]) == 0
    text = capsys.readouterr().out
    assert "pair_style mliap unified tiny.mliap.pkl 1" in text and "comm_modify cutoff 7" in text
    with open(out, "rb") as f:
        obj = pickle.load(f)
    assert isinstance(obj, CgforgeMLIAP) and obj.patch is False and obj.element_types == ["H", "O"]
    atoms = structure()
    got, _ = run(obj, atoms, mode="ghost", n_domains=1)
    assert_matches(got, reference(mace_file, atoms, patch=False))
    # never over IN, never over an existing OUT without --force; .pt is written with torch.save
    assert cli_main(["lammps-model", mace_file, mace_file]) == 1
    assert cli_main(["lammps-model", mace_file, str(out)]) == 1
    assert "exists" in capsys.readouterr().err
    pt = tmp_path / "tiny.pt"
    assert cli_main(["lammps-model", mace_file, str(pt), "--patch", "off"]) == 0
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1" in capsys.readouterr().out
    assert isinstance(torch.load(pt, weights_only=False), CgforgeMLIAP)
    # --cuda-graph: the option travels in the file; a combination that cannot work fails before writing
    off = tmp_path / "off.pkl"
    assert cli_main(["lammps-model", mace_file, str(off), "--cuda-graph", "off"]) == 0
    with open(off, "rb") as f:
        assert pickle.load(f).cuda_graph is False
    capsys.readouterr()
    bad = tmp_path / "bad.pkl"
    assert cli_main(["lammps-model", mace_file, str(bad), "--cuda-graph", "on", "--device", "cpu"]) == 1
    assert "cuda_graph=True needs the model on a CUDA device" in capsys.readouterr().err and not bad.exists()
    # exchange mode is captured on one rank: the combination is written (several ranks fail at the call, by name)
    exchange = tmp_path / "exchange.pkl"
    assert cli_main(["lammps-model", mace_file, str(exchange), "--cuda-graph", "on", "--mode", "exchange"]) == 0
    with open(exchange, "rb") as f:
        written = pickle.load(f)
    assert written.cuda_graph is True and written.mode == "exchange"


def test_cli_rejects_unsupported_models(tmp_path, capsys):
    bad = tmp_path / "linear.model"
    torch.save(torch.nn.Linear(2, 2), bad)
    assert cli_main(["lammps-model", str(bad), str(tmp_path / "out.pkl")]) == 1
    assert "expected a whole pickled MACE model" in capsys.readouterr().err
    assert not (tmp_path / "out.pkl").exists()
    assert cli_main(["lammps-model", str(tmp_path / "none.model"), str(tmp_path / "out.pkl")]) == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("padded", [False, True])
def test_atoms_without_pairs(mace_file, padded):
    """Isolated atoms: no pairs, energies only (the model's reference energies), zero forces."""
    atoms = Atoms("OH", positions=[[1.0, 1.0, 1.0], [6.0, 6.0, 6.0]], cell=[12.0, 12.0, 12.0], pbc=True)
    obj = CgforgeMLIAP(mace_file, patch=padded, _padded=padded)
    got, domains = run(obj, atoms, mode="ghost", n_domains=1, path="padded" if padded else "eager")
    assert domains[0].npairs == 0 and domains[0].pair_force_calls == 0
    ref = reference(mace_file, atoms, patch=False)
    assert abs(got["energy"] - ref["energy"]) < TOL * abs(ref["energy"])
    assert np.allclose(got["energies"], ref["energies"], rtol=TOL, atol=0) and not got["forces"].any()


# --- the padded step (cgforge.plugin.lammps.captured): the same code that CUDA captures, run eagerly on the CPU ---


def domains_of(obj: CgforgeMLIAP, atoms: Atoms, n_domains: int = 1, **kw) -> list[StandInData]:
    return build_domains(atoms, obj.element_types, obj.cutoff, obj.ghost_cutoff, n_domains=n_domains, **kw)


def per_domain(obj: CgforgeMLIAP, data: StandInData) -> dict:
    """One compute_forces of ``obj`` on ``data``: what it wrote, as assert_matches reads it."""
    run_domains([obj], [data])
    return {"energy": data.energy_written, "energies": data.eatoms_written.copy(), "forces": data.f.copy(),
            "virial": data.virial.copy()}


@pytest.mark.parametrize("n_domains, kind", [  # the fast tier: one domain, MACE
    case if case == (1, "mace") else pytest.param(*case, marks=pytest.mark.slow)
    for case in itertools.product([1, 2], ["mace", "nequip"])])
def test_padded_step_matches(kind, n_domains, request):
    """Padded buffers, a pinned graph without a sort, species in fixed rooms: equal to the eager path and the
    Calculator (cgforge's kernels on all three), on one domain and two."""
    path = request.getfixturevalue(f"{kind}_file")
    atoms = structure(seed=11)
    padded = CgforgeMLIAP(path, patch=True, _padded=True)
    got, domains = run(padded, atoms, mode="ghost", n_domains=n_domains, path="padded")
    eager, _ = run(CgforgeMLIAP(path, patch=True), atoms, mode="ghost", n_domains=n_domains, path="eager")
    ref = reference(path, atoms, patch=True)
    assert_matches(got, ref)
    assert_matches(got, eager)
    assert_matches(eager, ref)


@pytest.mark.slow
def test_padded_step_grows_and_shrinks(mace_file):
    """One object over calls whose pair, atom and species counts grow and shrink: LAMMPS's buffers grow (a new
    capture on CUDA) and never shrink, the receptive field's rooms follow the field (the first call runs on every
    pair, later ones on the field: the eager path's field exactly), stale entries past the counts change nothing,
    every call equals the eager path's."""
    padded = CgforgeMLIAP(mace_file, patch=True, _padded=True)
    eager = CgforgeMLIAP(mace_file, patch=True)
    small, big = structure(seed=12), water_box(24, seed=3)
    big.rattle(0.05, seed=3)
    calls = [(small, 2, 1), (small, 2, 0), (big, 1, 0), (small, 2, 1), (small, 2, 1)]
    seen = []
    for atoms, n_domains, d in calls:
        got = per_domain(padded, domains_of(padded, atoms, n_domains)[d])
        want = per_domain(eager, domains_of(eager, atoms, n_domains)[d])
        assert padded.last_path == "padded" and eager.last_path == "eager"
        assert_matches(got, want)
        assert padded.last_field == eager.last_field  # the same cut, made on the device
        (nodes, edges), (atoms_given, pairs_given) = padded.last_field
        assert nodes < atoms_given and edges < pairs_given
        step = padded._step
        seen.append((step.capacities, step._buf.atoms, step._buf.edges, step.n_growths, edges))
    (first, atoms0, _, grown0, _), _, (third, atoms2, _, grown2, _), (fourth, _, _, _, _), last = seen
    assert grown0 == 1  # the first call ran on every pair, then the field got a room of its own
    assert grown2 > grown0 and third[0] > first[0] and atoms2 > atoms0  # the big box grew LAMMPS's buffers
    assert fourth[0] == third[0]  # ... which never shrink
    assert last[2] < third[0] and last[4] <= last[2] <= 1.5 * last[4] + 256  # the layout: the field and its room
    assert padded._step._pair_margin >= 2 * PAIR_MARGIN  # the pairs outgrew their room: more room since


def relabel_ghosts(data: StandInData, seed: int) -> None:
    """Permute the ghosts' indices in place: pairs stay grouped by centre, centres no longer ascend."""
    n, total = data.nlocal, data.ntotal
    new = np.arange(total)
    new[n:] = n + np.random.default_rng(seed).permutation(total - n)
    host = data._host
    for name in ("pair_i", "jatoms"):
        host[name] = new[host[name]].astype(np.int32)
    for name in ("elems",):
        moved = np.empty_like(host[name])
        moved[new] = host[name]
        host[name] = moved
    gid, owner = np.empty_like(data.gid), np.empty_like(data.owner)
    gid[new], owner[new] = data.gid, data.owner
    data.gid, data.owner = gid, owner


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_padded_step_falls_back_when_centres_do_not_ascend(mace_file, device):
    """Grouped but not ascending: the device flag sends the call (and later ones) to the eager path, once warned
    (on CUDA: from the captured step)."""
    atoms = structure(seed=13)
    obj = CgforgeMLIAP(mace_file, patch=True, device=device, _padded=True)
    kw = {"flavour": "kokkos", "device": device} if device == "cuda" else {}
    (data,) = domains_of(obj, atoms, **kw)
    relabel_ghosts(data, seed=1)
    centres = data._host["pair_i"]
    assert (np.diff(centres) < 0).any() and (np.diff(centres) != 0).sum() == len(np.unique(centres)) - 1
    with pytest.warns(RuntimeWarning, match="ascending centre order"):
        run_domains([obj], [data])
    assert obj.last_path == "eager" and "ascending" in obj.padded_off
    ref = reference(mace_file, atoms, patch=True)
    assert_matches(combine([data], len(atoms)), ref)
    assert obj.capture_error is None and obj._step.n_captures == (device == "cuda")
    (data,) = domains_of(obj, atoms, **kw)  # ascending again: the object stays on the eager path, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_domains([obj], [data])
    assert obj.last_path == "eager"
    assert_matches(combine([data], len(atoms)), ref)


@pytest.mark.slow
def test_cuda_graph_option(mace_file):
    with pytest.raises(TypeError, match="cuda_graph"):
        CgforgeMLIAP(mace_file, cuda_graph="on")
    with pytest.raises(TypeError, match="cuda_graph"):
        CgforgeMLIAP(mace_file, cuda_graph=1)
    with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
        CgforgeMLIAP(mace_file, cuda_graph=True, device="cpu")
    obj = CgforgeMLIAP(mace_file, patch=False, cuda_graph=True)  # the device is known at the first call
    (data,) = domains_of(obj, structure())
    with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
        obj.compute_forces(data)
    # None: eager on a CPU, and nothing of a padded step travels in the pickle
    auto = CgforgeMLIAP(mace_file, patch=False)
    auto.compute_forces(data)
    assert auto.last_path == "eager" and auto._step is None and auto.capture_error is None
    padded = CgforgeMLIAP(mace_file, patch=True, _padded=True)
    (data,) = domains_of(padded, structure())
    padded.compute_forces(data)
    state = padded.__getstate__()
    assert padded._step is not None and "_step" not in state and "padded_off" not in state
    assert pickle.loads(pickle.dumps(padded))._step is None
    # a file written before cuda_graph existed loads with the default
    old = {k: v for k, v in auto.__getstate__().items()
           if k not in ("cuda_graph", "_padded", "inert_edges_reason", "last_path")}
    again = CgforgeMLIAP.__new__(CgforgeMLIAP)
    again.__setstate__(old)
    assert again.cuda_graph is None and not again._padded
    again.compute_forces(data)
    assert again.last_path == "eager" and again.inert_edges_reason is None


# --- CUDA: the captured step --------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["mace", "nequip"])
@pytest.mark.parametrize("flavour", ["host", "kokkos"])
def test_cuda_captured_step(kind, flavour, request):
    """Captured equals eager on the GPU (FP64, 1e-9 relative) per domain, replays, and captures again after a
    growth; host arrays (model on cuda) and Kokkos device arrays."""
    path = request.getfixturevalue(f"{kind}_file")
    kw = {"flavour": flavour, "device": "cuda"}
    captured = CgforgeMLIAP(path, patch=True, device="cuda")
    eager = CgforgeMLIAP(path, patch=True, device="cuda", cuda_graph=False)
    small, big = structure(seed=14), water_box(24, seed=4)
    big.rattle(0.05, seed=4)
    captures = []
    for atoms, n_domains, d in [(small, 2, 0), (small, 2, 1), (big, 1, 0), (big, 1, 0), (small, 2, 0)]:
        got = per_domain(captured, domains_of(captured, atoms, n_domains, **kw)[d])
        want = per_domain(eager, domains_of(eager, atoms, n_domains, **kw)[d])
        assert captured.last_path == "captured" and eager.last_path == "eager"
        assert captured.capture_error is None
        assert_matches(got, want, tol=1e-9)
        captures.append(captured._step.n_captures)
    assert captures[0] == 1 and captures[2] > captures[1] and captures[3] == captures[2] == captures[4]
    atoms = structure(seed=15)
    got, _ = run(captured, atoms, mode="ghost", n_domains=2, path="captured", **kw)
    assert_matches(got, reference(path, atoms, patch=True), tol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mace", "nequip"])
def test_radial_tables_match_the_calculator_with_tables(kind, request):
    """radial_table=True (CPU, cgforge's kernels): the Calculator with its radial tables, to 1e-10, in exchange mode
    on two domains and ghost mode on one; and not the radial MLP's numbers (the tables are in use)."""
    path = request.getfixturevalue(f"{kind}_file")
    atoms = structure()

    def calculator(tables: bool) -> dict:
        a = atoms.copy()
        a.calc = Calculator(path, device="cpu", patch=True, radial_table=tables)
        return {"energy": a.get_potential_energy(), "energies": a.get_potential_energies(), "forces": a.get_forces(),
                "virial": -a.get_stress(voigt=False) * a.get_volume()}

    with_tables, with_mlp = calculator(True), calculator(False)
    for mode, n_domains in (("exchange", 2), ("ghost", 1)):
        got, _ = run(CgforgeMLIAP(path, patch=True, radial_table=True), atoms, mode=mode, n_domains=n_domains)
        assert_matches(got, with_tables)
        forces_off = np.linalg.norm(got["forces"] - with_mlp["forces"]) / np.linalg.norm(with_mlp["forces"])
        assert 1e-12 < forces_off < 1e-5, forces_off


@pytest.mark.slow
def test_radial_table_option(mace_file, tmp_path, capsys):
    with pytest.raises(TypeError, match="radial_table"):
        CgforgeMLIAP(mace_file, radial_table="on")
    assert CgforgeMLIAP(mace_file).radial_table is None  # the default follows the Calculator
    obj = CgforgeMLIAP(mace_file, patch=True, radial_table=None)
    assert pickle.loads(pickle.dumps(obj)).radial_table is None
    # None follows the Calculator (the runtime's rule, ``Potential``): off on a CPU
    obj.setup("cpu")
    assert obj._potential.radial_table is False and obj._potential.patched
    old = obj.__getstate__()
    del old["radial_table"]  # a file written before the option: the radial MLP, as then
    restored = CgforgeMLIAP.__new__(CgforgeMLIAP)
    restored.__setstate__(old)
    assert restored.radial_table is False
    out = tmp_path / "tables.mliap.pkl"
    assert cli_main(["lammps-model", mace_file, str(out), "--radial-table", "on"]) == 0
    with open(out, "rb") as f:
        assert pickle.load(f).radial_table is True
    # True where the model will not run cgforge's kernels is refused at once (the CLI before writing)
    with pytest.raises(ValueError, match="radial_table=True, patch=False"):
        CgforgeMLIAP(mace_file, radial_table=True, patch=False)
    refused = tmp_path / "refused.pkl"
    assert cli_main(["lammps-model", mace_file, str(refused), "--radial-table", "on", "--patch", "off"]) == 1
    assert "radial_table=True" in capsys.readouterr().err and not refused.exists()
    # patch=None patches the model for them, on a CPU too (the runtime's rule, as the Calculator)
    tables = CgforgeMLIAP(mace_file, radial_table=True, device="cpu")
    tables.setup("cpu")
    assert tables._potential.patched and tables._potential.radial_table
    default = tmp_path / "default.mliap.pkl"
    assert cli_main(["lammps-model", mace_file, str(default)]) == 0
    with open(default, "rb") as f:
        assert pickle.load(f).radial_table is None


# --- exchange mode on one rank: the ghosts' owners, no exchange inside the model -------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mace", "nequip"])
def test_one_rank_exchange_runs_on_the_owners(kind, request):
    """Exchange mode on one domain (one rank): one exchange finds every ghost's owner, the padded step runs the
    model on the local atoms with each ghost neighbour rewired to its owner, and no feature is exchanged inside the
    model: the Calculator's numbers and the eager exchange path's (cgforge's kernels, FP64, 1e-10). Two domains
    have ghosts of the other rank: they find that and exchange features as before."""
    path = request.getfixturevalue(f"{kind}_file")
    atoms = structure(seed=21)
    ref = reference(path, atoms, patch=True)
    obj = CgforgeMLIAP(path, patch=True, _padded=True)
    (data,) = build_domains(atoms, obj.element_types, obj.cutoff, obj.cutoff, ghost_neighbours=False, exchange=True,
                            flavour="kokkos")
    assert data.ntotal > data.nlocal == len(atoms)
    run_domains([obj], [data])
    assert obj.last_mode == "exchange" and obj.last_path == "padded" and obj.ranks == 1
    assert obj.owner_exchanges == 1 and obj._hooks.calls == 0 and obj.exchanges == 1
    assert [w for _, w in data.exchange_log] == [3]  # the owners' exchange only
    # nodes and listed atoms: exactly the local atoms, not the ghosts; pairs: the first, small room
    assert obj._step.capacities[1:] == (data.nlocal, data.nlocal) < (data.ntotal, data.ntotal)
    assert data.npairs <= obj._step.capacities[0] <= room(data.npairs, PAIR_MARGIN)
    got = combine([data], len(atoms))  # ghost forces summed into their owners, as LAMMPS's reverse comm does
    assert_matches(got, ref)
    eager, _ = run(CgforgeMLIAP(path, patch=True), atoms, mode="exchange", n_domains=1, path="eager")
    assert_matches(got, eager)
    split, domains = run(CgforgeMLIAP(path, patch=True, _padded=True), atoms, mode="exchange", n_domains=2,
                         path="eager")
    assert_matches(split, ref)
    assert all(len(d.exchange_log) > 1 for d in domains)  # the owners' exchange, then the features


def _one_domain(obj: CgforgeMLIAP, atoms: Atoms, **kw) -> StandInData:
    (data,) = build_domains(atoms, obj.element_types, obj.cutoff, obj.cutoff, ghost_neighbours=False, exchange=True,
                            flavour="kokkos", **kw)
    return data


@pytest.mark.slow
@pytest.mark.parametrize("padded", [True, False])
def test_one_rank_owners_are_kept_while_the_ghosts_stand(mace_file, padded):
    """The owners found by one exchange serve the next calls while every ghost is still its owner's image (moved
    atoms, the same ghost list: no exchange); a rebuilt ghost list with the same counts (the atoms renumbered, as
    LAMMPS's sorting does) fails the positions' check and is found again (padded step: after the step ran, from its
    flag; eager: before). Every call equals the Calculator (FP64, 1e-10)."""
    atoms = structure(seed=25)
    obj = CgforgeMLIAP(mace_file, patch=True, _padded=padded, cuda_graph=None if padded else False)
    path = "padded" if padded else "eager"

    def call(structure: Atoms, expect_exchanges: int, expect_reuses: int) -> StandInData:
        data = _one_domain(obj, structure)
        run_domains([obj], [data])
        assert obj.last_path == path and obj._hooks.calls == 0
        assert (obj.owner_exchanges, obj._owners.reuses) == (expect_exchanges, expect_reuses)
        assert_matches(combine([data], len(structure)), reference(mace_file, structure, patch=True))
        return data

    first = call(atoms, 1, 0)
    again = call(atoms, 1, 1)
    assert again.exchange_log == [] and first.exchange_log == [("forward", 3)]
    moved = atoms.copy()
    moved.positions += np.random.default_rng(1).normal(0, 0.003, moved.positions.shape)
    assert _one_domain(obj, moved).ntotal == first.ntotal  # the same ghosts, moved with their owners
    call(moved, 1, 2)
    renumbered = atoms[np.random.default_rng(2).permutation(len(atoms))]
    assert _one_domain(obj, renumbered).ntotal == first.ntotal
    call(renumbered, 2, 3)  # the kept map was checked (a reuse), found stale, and found again
    if padded:
        assert obj._step.n_captures == 0 and obj.padded_off is None


@pytest.mark.slow
def test_a_changing_box_stops_keeping_the_owners(mace_file):
    """A box that changes at every step (NPT) moves every shift: the kept owners fail the check once, the refresh
    finds the same owners, and from then on every call exchanges (no call runs twice). The Calculator's numbers."""
    atoms = structure(seed=27)
    obj = CgforgeMLIAP(mace_file, patch=True, _padded=True)
    counts = []
    for scale in (1.0, 1.002, 1.004, 1.006):
        box = atoms.copy()
        box.set_cell(atoms.cell * scale, scale_atoms=True)
        data = _one_domain(obj, box)
        run_domains([obj], [data])
        assert obj.last_path == "padded"
        assert_matches(combine([data], len(box)), reference(mace_file, box, patch=True))
        counts.append((obj.owner_exchanges, obj._owners.reuses, obj._owners.refreshes, obj._owners.box_changes))
    assert _one_domain(obj, atoms).ntotal == data.ntotal  # the same ghosts throughout, only the box moved
    assert counts == [(1, 0, 0, False), (2, 1, 1, True), (3, 1, 1, True), (4, 1, 1, True)], counts


def test_one_rank_owners_without_positions_are_found_every_call(mace_file):
    """A couple with no positions (``x``) to check a kept map by: one owners' exchange per call."""
    atoms = structure(seed=26)
    obj = CgforgeMLIAP(mace_file, patch=True, _padded=True)
    for calls in (1, 2):
        data = _one_domain(obj, atoms, with_x=False)
        run_domains([obj], [data])
        assert obj.owner_exchanges == calls and obj._owners.reuses == 0 and data.exchange_log == [("forward", 3)]
    assert_matches(combine([data], len(atoms)), reference(mace_file, atoms, patch=True))


def test_owner_check_flags_any_displacement_and_nan():
    """``GhostMapCache``'s check: a ghost off its owner's image by more than the tolerance, or at NaN, is moved."""
    from cgforge.plugin.lammps.owners import TOLERANCE, GhostMapCache, displaced

    class Data:  # one local atom, two ghosts that are its images
        x = torch.tensor([[1.0, 2.0, 3.0], [11.0, 2.0, 3.0], [1.0, -8.0, 3.0]])

        def forward_exchange(self, src, dst, width):
            dst.copy_(src[[0] * src.shape[0]])  # every atom an image of the local one

    data, cache = Data(), GhostMapCache()
    ghosts, moved = cache.lookup(data, 1, 3, torch.device("cpu"))
    assert moved is None and ghosts.node_of.tolist() == [0, 0, 0] and cache.exchanges == 1
    for shift, expect in ((0.0, False), (0.5 * TOLERANCE, False), (2 * TOLERANCE, True), (float("nan"), True)):
        data.x = Data.x.clone()
        data.x[0] += 0.25  # the owner moves, its ghosts with it ...
        data.x[1:] += 0.25
        data.x[2, 1] += shift  # ... but one of them by `shift` more
        kept, check = cache.lookup(data, 1, 3, torch.device("cpu"))
        assert kept is ghosts and bool(check.moved()) is expect, shift
        # the padded step's form: buffers longer than the atoms, rows past the count stale and never read
        stale = torch.full((2, 3), 99.0)
        x, shift_rows = torch.cat([check.x, stale]), torch.cat([check.shift, -stale])
        node_of = torch.cat([check.node_of, torch.tensor([0, 1])])
        assert bool(displaced(x, node_of, shift_rows, TOLERANCE, torch.tensor(3))) is expect, shift
        assert bool(displaced(x, node_of, shift_rows, TOLERANCE, torch.tensor(5)))  # the stale rows, read
    data.x = torch.cat([Data.x, Data.x[:1] + 10.0])  # one more ghost: the counts changed, found again
    ghosts, moved = cache.lookup(data, 1, 4, torch.device("cpu"))
    assert moved is None and cache.exchanges == 2 and ghosts.node_of.tolist() == [0, 0, 0, 0]


def test_several_ranks_never_take_the_one_rank_shortcut(mace_file):
    """With the launcher's rank count above one, no rank looks for owners (the shortcut is all ranks' or none's):
    every ghost a node, the eager exchange path."""
    atoms = structure(seed=22)
    obj = CgforgeMLIAP(mace_file, patch=True, _padded=True)
    (data,) = build_domains(atoms, obj.element_types, obj.cutoff, obj.cutoff, ghost_neighbours=False, exchange=True,
                            flavour="kokkos")
    obj.prepare(data)
    obj.ranks = 2
    run_domains([obj], [data])
    assert obj.last_path == "eager" and obj.owner_exchanges == 0 and obj._hooks.calls > 0
    assert_matches(combine([data], len(atoms)), reference(mace_file, atoms, patch=True))


def test_launcher_ranks():
    from cgforge.plugin.lammps.ranks import launcher_ranks

    assert launcher_ranks({}) == 1
    assert launcher_ranks({"OMPI_COMM_WORLD_SIZE": "1"}) == 1
    assert launcher_ranks({"OMPI_COMM_WORLD_SIZE": "4"}) == 4
    assert launcher_ranks({"PMI_SIZE": "2", "SLURM_NTASKS": "8"}) == 8
    assert launcher_ranks({"PMI_SIZE": "two", "MV2_COMM_WORLD_SIZE": "0"}) == 1  # not a rank count: skipped


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["mace", "nequip"])
def test_cuda_one_rank_exchange_is_captured(kind, request):
    """Exchange mode on one GPU domain (Kokkos device arrays): captured, equal to the eager exchange path (FP64,
    1e-9), replayed on a second call; cuda_graph=True with several ranks fails by name."""
    path = request.getfixturevalue(f"{kind}_file")
    atoms = structure(seed=23)
    kw = {"ghost_neighbours": False, "exchange": True, "flavour": "kokkos", "device": "cuda"}
    captured = CgforgeMLIAP(path, patch=True, device="cuda")
    eager = CgforgeMLIAP(path, patch=True, device="cuda", cuda_graph=False)
    for _ in range(2):
        (a,) = build_domains(atoms, captured.element_types, captured.cutoff, captured.cutoff, **kw)
        (b,) = build_domains(atoms, eager.element_types, eager.cutoff, eager.cutoff, **kw)
        run_domains([captured], [a])
        run_domains([eager], [b])
        got, want = combine([a], len(atoms)), combine([b], len(atoms))
        assert captured.last_path == "captured" and captured.capture_error is None and eager.last_path == "eager"
        assert_matches(got, want, tol=1e-9)
    assert captured._step.n_captures == 1
    assert (captured.owner_exchanges, captured._owners.reuses) == (1, 1)  # the second call kept the owners
    assert_matches(got, reference(path, atoms, patch=True), tol=1e-9)
    # the atoms renumbered (the same counts): the kept owners fail the check inside the captured step, which is
    # replayed again on owners found afresh
    renumbered = atoms[np.random.default_rng(3).permutation(len(atoms))]
    (r,) = build_domains(renumbered, captured.element_types, captured.cutoff, captured.cutoff, **kw)
    run_domains([captured], [r])
    assert captured.last_path == "captured" and captured._owners.refreshes == 1 and captured._step.n_captures == 1
    assert_matches(combine([r], len(atoms)), reference(path, renumbered, patch=True), tol=1e-9)
    insist = CgforgeMLIAP(path, patch=True, device="cuda", cuda_graph=True)
    (c,) = build_domains(atoms, insist.element_types, insist.cutoff, insist.cutoff, **kw)
    insist.prepare(c)
    insist.ranks = 2
    with pytest.raises(LammpsSetupError, match="2 MPI ranks"):
        insist.compute_forces(c)


@pytest.mark.slow
def test_two_domains_exchange_only_the_other_ranks_ghosts():
    """Two domains of one process (the launcher's one rank, as the stand-in's threads are): ghosts that are periodic
    images of the domain's own atoms are rewired to them, so the model's nodes are the local atoms and the other
    domain's ghosts only, and only those are exchanged; float32 features go forward packed two to a float64 word.
    The Calculator's numbers (FP32 model: 5e-6)."""
    from cgforge.plugin.lammps import exchange

    torch.set_default_dtype(torch.float32)
    from mace_helpers import build_model

    model = build_model(r_max=R_MAX).float()
    atoms = structure(seed=24)
    seen = []
    real = exchange.ghost_map

    def spy(*args, **kw):
        ghosts = real(*args, **kw)
        seen.append(ghosts)
        return ghosts

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/fp32.model"
        torch.save(model, path)
        obj = CgforgeMLIAP(path, patch=False)
        from unittest import mock

        with mock.patch("cgforge.plugin.lammps.owners.ghost_map", spy):
            got, domains = run(obj, atoms, mode="exchange", n_domains=2, path="eager")
        ref = reference(path, atoms, patch=False)
    assert_matches(got, ref, tol=5e-6)  # float32 rounding (summation order); the packing itself is exact (below)
    for d, ghosts in zip(domains, seen):
        assert 0 < ghosts.remote.shape[0] < d.ntotal - d.nlocal  # some ghosts are own images, some the other's
        assert ghosts.nodes < d.ntotal and int(ghosts.node_of.max()) == ghosts.nodes - 1
        forward = [w for way, w in d.exchange_log if way == "forward"][1:]  # after the owners' exchange
        reverse = [w for way, w in d.exchange_log if way == "reverse"]
        assert sum(reverse) == 2 * sum(forward) - (sum(reverse) % 2)  # float32 pairs in float64 words (odd: padded)


@pytest.mark.parametrize("width", [5, 8])
def test_float32_forward_packing_is_bit_exact(width):
    """Float32 features packed two to a float64 word come back bit for bit through a copying exchange, NaNs,
    infinities, denormals and signed zeros included (odd widths padded), in host blocks as on a Kokkos host build."""
    from cgforge.plugin.lammps.exchange import _send_forward

    class Copying:
        def forward_exchange(self, src, dst, width):
            assert src.dtype == torch.float64 and width <= 6
            dst.copy_(src)

    bits = torch.randint(-2**31, 2**31 - 1, (40, width), dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0x7FC00001, 0x7F800001, 0xFF800000, 0x00000001, 0x80000000], dtype=torch.int64)
    bits[:5, 0] = special.to(torch.int32)
    feats = bits.view(torch.float32)
    got = _send_forward(Copying(), feats)
    assert got.shape == feats.shape and torch.equal(got.contiguous().view(torch.int32), bits)


@pytest.mark.parametrize("mode", ["auto", "ghost", "exchange"])
def test_usage_lines_are_those_of_the_mode(mode):
    """`cgforge lammps-model --mode exchange` printed ghost mode's pair_style as the active line and no exchange
    comm_modify (issue 63): each mode's own lines are the active ones (auto: ghost's, exchange's as comments)."""
    from types import SimpleNamespace

    from cgforge.plugin.lammps.write import usage_lines

    obj = SimpleNamespace(kind="mace", layers=2, cutoff=5.0, ghost_cutoff=10.0, element_types=["H", "O"], mode=mode,
                          timers=False)
    lines = usage_lines(obj, "w.pkl", skin=1.0)
    active = [line.split("#")[0].strip() for line in lines if not line.startswith("#")]
    flag, cutoff = ("0", 6) if mode == "exchange" else ("1", 11)
    assert active == [f"pair_style mliap unified w.pkl {flag}", "pair_coeff * * H O", f"comm_modify cutoff {cutoff}"]
    commented = [line for line in lines if line.startswith("# pair_style") or line.startswith("# comm_modify")]
    assert commented == (["# pair_style mliap unified w.pkl 0", "# comm_modify cutoff 6   # cutoff 5 + skin 1"]
                         if mode == "auto" else [])
