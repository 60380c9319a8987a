"""The hardware floor of one whole MD force step (energy + forces: forward + backward), stage by stage (CPU).

    python benchmarks/step_floor.py [--model mace-mp-medium] [--atoms 5184] [--bandwidth-gbs 3350] [--tflops 66.9]
        [--l2-gbs 12391] [--radial table|mlp] [--beside h200,device]

Models: ``mace-mp-medium`` (shapes.mace_mp_shape, FP32), ``bundled-mace`` and ``bundled-nequip`` (the bundled water
models), ``nequip-M`` (shapes.nequip_shape("M")). The system is ``water_box(n_molecules=atoms // 3)``; its edges
are counted exactly by ``neighbour_list`` at the model's cutoff. The model is patched on the CPU (the kernel
objects exist without a GPU) and its modules are walked: each stage below is priced from the patched module's own
problem or irreps. Nothing runs on a GPU, so a GPU run can print this floor beside the step it measures.

What is counted, per stage (one row per stage and layer; FP32, 4-byte items, 4-byte indices):

- a row's bytes are what its kernels must read and write in DRAM, forward + backward, each input read once and each
  output written once; its FLOPs are 2 per multiply-add of its arithmetic, forward + backward; its L2 bytes are the
  DRAM bytes (every one passes through L2) plus what the row re-reads from L2 (the radial table's cubics, below).
  Its floor is max(bytes / DRAM bandwidth, L2 bytes / L2 bandwidth, FLOPs / peak) for the row as a whole; the step's floor is the sum of the rows' floors
  (stages run one after the other: no overlap between them).
- backward: each stage's own count, the gradients an MD step needs (to the positions; the weights are frozen, so
  no weight gradients anywhere). Stages whose input does not depend on the positions have no backward: the node
  embedding, and in the first layer the linear and the self-connection applied to the embedded features.
- convolution: ``bench_layer.layer_floor`` of the layer's ``Convolution.problem`` unchanged (its ``fb`` bytes and
  FLOPs: CG multiply-adds of the generated forward and backward programs; x, out, g, grad x rows once; per edge
  the spherical harmonics, the length, three indices, and grad y and grad r). It counts grad x in the first layer
  too: cgforge's backward kernel writes it there.
- radial weights: ``--radial table`` (the default, and what the runtime does for an FP32 model on CUDA: radial
  tables on, read inside the convolution) is no kernel and no byte beyond the length layer_floor already reads (the
  table's cubics stay in L2; their FLOPs are not counted, as in layer_floor). ``--radial mlp`` (what runs with
  tables off: FP64, CPU, or ``radial_table=False``): the basis once (read r, write the basis; backward read each
  layer's basis gradient, write grad r), then per layer the MLP's GEMMs (2 E in out FLOPs a layer forward, the same
  backward: grad input only) with each activation written and read once (backward: the gradients and the saved
  pre-activations), and the convolution's read of W and write of grad W beyond layer_floor's length and grad r.
- node-wise linears (e3nn Linear, SplitLinear, NequIP's scalar layers, readouts): 2 N sum(mul_in mul_out dim)
  FLOPs over the paths between equal irreps, bytes N (in + out) each way. The species self-connections count the
  same (one matrix per atom's species; cgforge's runtime groups atoms by species). The node embedding: a one-hot
  linear (MACE) or a table lookup (NequIP: write N x features, no FLOPs); no backward.
- symmetric contraction (MACE): bytes of ``bench_symmetric_contraction.floors`` (read x, write out; backward read x
  and grad, write grad x); FLOPs 2 N channels times the multiply-adds of the generated forward and (grad x only)
  backward programs.
- spherical harmonics: read the edge vector, write (l_max + 1)^2 values per edge; backward read every layer's grad
  of them (autograd's sum of the layers' gradients counted as fused into this read), the vector, write grad vector.
  FLOPs not counted (under 1 FLOP per byte: never the bound at 20 FLOP/B).
- edge geometry: forward read sender and receiver, write the vector and the length (the positions once); backward
  read grad vector, every layer's grad r, the vector and the length, the transposed order, and write the forces
  (two segment sums over the CSR orders: no atomics).

Not counted: L2 reuse is free (gathers of node rows, tables, weights: each node row is read once per kernel,
whatever its edges); the neighbour-list rebuild (amortised over the Verlet skin's steps, excluded); elementwise
glue fused into a neighbour (activations and gates, residual adds, the 1/avg_num_neighbors scale, MACE's irrep
reshape, scale-shift, the energy sum and the species index lookups); launches, synchronisation, integrator and
host work; atomics (none: every scatter is a CSR segment sum). Every count is under the truth, so the total is a
lower bound of the step on a device of this bandwidth and FP32 (non-tensor) peak. Defaults: 3350 GB/s, the H100
SXM data sheet's HBM3 bandwidth (bench_layer measures a copy instead), 66.9 TFLOP/s, bench_layer's FP32 peak
for H100/H200, and the H100's L2 bandwidth of ``KNOWN_RATES`` (derived there: NVIDIA publishes none for Hopper).
``--beside`` adds a floor column per named rate set: ``h100``, ``h200`` (``KNOWN_RATES``) or ``device`` (this
machine's GPU: ``device_rates``, its SMs, clocks and memory bus read from the device, the rest from the table).
Prints the table and the totals; JSON goes to benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_layer import FP32_PEAK_TFLOPS, layer_floor  # noqa: E402
from bench_symmetric_contraction import floors as sc_floors  # noqa: E402
from common import environment, write_json  # noqa: E402

from cgforge.kernels import Convolution  # noqa: E402

MODELS = ("mace-mp-medium", "bundled-mace", "bundled-nequip", "nequip-M")
H100_SXM_GBS = 3350.0  # NVIDIA H100 SXM data sheet: HBM3, 3.35 TB/s
ITEM, INDEX = 4, 4  # FP32 values, int32 indices
CUBIC = 4  # coefficients of one weight's cubic in one interval of a radial table

# L2 read bandwidth per SM per clock, bytes, by compute capability. NVIDIA's A100 whitepaper gives the A100's L2 read
# bandwidth as 5120 bytes/clock over its 108 SMs; NVIDIA publishes no such figure for Hopper, taken as the same per
# SM (an estimate: --l2-gbs takes a measured one).
L2_BYTES_PER_CLOCK_PER_SM = {(8, 0): 5120 / 108, (9, 0): 5120 / 108}
FP32_LANES_PER_SM = {(8, 0): 64, (9, 0): 128}  # FP32 FMA units per SM: the A100 and H100 whitepapers


@dataclass(frozen=True)
class Rates:
    """A device's DRAM and L2 bandwidth (GB/s) and FP32 (non-tensor) peak (TFLOP/s), and where each number comes
    from (``sources``: field -> text)."""

    name: str
    hbm_gbs: float
    l2_gbs: float
    tflops: float
    sources: tuple[tuple[str, str], ...] = ()


def _l2_gbs(capability: tuple[int, int], sms: int, clock_ghz: float) -> float:
    return L2_BYTES_PER_CLOCK_PER_SM[capability] * sms * clock_ghz


_L2_HOPPER = ("l2_gbs", "5120 B/clock per 108 SMs (A100 whitepaper) x 132 SMs x 1.98 GHz: an estimate, NVIDIA "
                        "publishes no Hopper L2 bandwidth")
KNOWN_RATES = {
    # 132 SMs at 1.98 GHz: 132 x 128 FP32 lanes x 2 x 1.98 GHz = 66.9 TFLOP/s, the data sheets' FP32 peak
    "h100": Rates("H100 SXM", H100_SXM_GBS, _l2_gbs((9, 0), 132, 1.98), FP32_PEAK_TFLOPS["H100"], (
        ("hbm_gbs", "H100 SXM data sheet: HBM3 3.35 TB/s"), _L2_HOPPER,
        ("tflops", "H100 SXM data sheet: FP32 66.9 TFLOP/s"))),
    "h200": Rates("H200 SXM", 4800.0, _l2_gbs((9, 0), 132, 1.98), FP32_PEAK_TFLOPS["H200"], (
        ("hbm_gbs", "H200 data sheet: HBM3e 4.8 TB/s"), _L2_HOPPER,
        ("tflops", "H200 data sheet: FP32 67 TFLOP/s (the H100's SMs and clock: 66.9)"))),
}


def rates_from_properties(name: str, capability: tuple[int, int], sms: int, clock_khz: float | None,
                          memory_clock_khz: float | None, bus_bits: int | None) -> Rates:
    """A device's rates from what it reports: FP32 peak = SMs x FP32 lanes x 2 x clock, L2 = SMs x
    ``L2_BYTES_PER_CLOCK_PER_SM`` x clock, DRAM = 2 (double data rate) x memory clock x bus width; a value the
    device does not report (None), or a compute capability not in the tables, comes from the ``KNOWN_RATES`` entry
    whose name the device's contains (ValueError when none does)."""
    known = next((r for key, r in KNOWN_RATES.items() if key in name.lower()), None)
    sources = dict(known.sources) if known is not None else {}
    values = {} if known is None else {"hbm_gbs": known.hbm_gbs, "l2_gbs": known.l2_gbs, "tflops": known.tflops}
    if clock_khz and capability in FP32_LANES_PER_SM:
        ghz = clock_khz / 1e6
        values["tflops"] = sms * FP32_LANES_PER_SM[capability] * 2 * ghz / 1e3
        sources["tflops"] = f"the device: {sms} SMs x {FP32_LANES_PER_SM[capability]} lanes x 2 x {ghz:.3f} GHz"
        values["l2_gbs"] = _l2_gbs(capability, sms, ghz)
        sources["l2_gbs"] = (f"the device's {sms} SMs x {ghz:.3f} GHz x {L2_BYTES_PER_CLOCK_PER_SM[capability]:.1f} "
                             "B/clock per SM (the A100 whitepaper's; an estimate on Hopper)")
    if memory_clock_khz and bus_bits:
        values["hbm_gbs"] = 2 * memory_clock_khz * 1e3 * bus_bits / 8 / 1e9
        sources["hbm_gbs"] = f"the device: 2 x {memory_clock_khz / 1e3:.0f} MHz x {bus_bits}-bit bus"
    missing = sorted({"hbm_gbs", "l2_gbs", "tflops"} - set(values))
    if missing:
        raise ValueError(f"device {name!r} (compute capability {capability}): {', '.join(missing)} neither "
                         f"reported nor in step_floor.KNOWN_RATES ({', '.join(KNOWN_RATES)}); give them as flags")
    return Rates(name, values["hbm_gbs"], values["l2_gbs"], values["tflops"], tuple(sorted(sources.items())))


def device_rates(index: int = 0) -> Rates:
    """This machine's GPU ``index``: torch.cuda.get_device_properties (name, compute capability, SMs, and the
    clocks and memory bus where this torch reports them), else CUDA's device attributes through CuPy (clock rate,
    memory clock rate, global memory bus width), else ``KNOWN_RATES``."""
    props = torch.cuda.get_device_properties(index)
    clocks = {k: getattr(props, k, None) for k in ("clock_rate", "memory_clock_rate", "memory_bus_width")}
    if not all(clocks.values()):
        try:
            from cupy.cuda import runtime

            for key, attribute in (("clock_rate", 13), ("memory_clock_rate", 36), ("memory_bus_width", 37)):
                clocks[key] = clocks[key] or runtime.deviceGetAttribute(attribute, index)
        except Exception:  # noqa: BLE001 - no CuPy or no attribute: the table's values stand in
            pass
    return rates_from_properties(props.name, (props.major, props.minor), props.multi_processor_count,
                                 clocks["clock_rate"], clocks["memory_clock_rate"], clocks["memory_bus_width"])


@dataclass
class Row:
    """One stage of one layer: its kernels and bytes and FLOPs, forward and backward."""

    stage: str
    layer: str
    kernels: int = 0
    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    l2_reread: float = 0.0  # bytes read from L2 beyond the DRAM bytes, forward + backward (the radial table)
    floor_ms: float = 0.0
    bound: str = ""

    @property
    def bytes(self) -> float:
        return self.fwd_bytes + self.bwd_bytes

    @property
    def l2_bytes(self) -> float:
        """Bytes through L2: every DRAM byte, and the re-reads."""
        return self.bytes + self.l2_reread

    @property
    def flops(self) -> float:
        return self.fwd_flops + self.bwd_flops

    def add(self, kernels: int, fwd_bytes: float, bwd_bytes: float, fwd_flops: float, bwd_flops: float) -> None:
        self.kernels += kernels
        self.fwd_bytes += fwd_bytes
        self.bwd_bytes += bwd_bytes
        self.fwd_flops += fwd_flops
        self.bwd_flops += bwd_flops


# ---------------------------------------------------------------------------------------------------------------
# Models and systems


def load_model(name: str) -> torch.nn.Module:
    """The patched model ``name`` (one of MODELS) on the CPU, FP32."""
    from cgforge.patches import families

    if name == "mace-mp-medium":
        from shapes import mace_mp_shape

        return families.load(mace_mp_shape(torch.float32, "medium"), "cpu", patch=True)
    if name == "nequip-M":
        from shapes import nequip_shape

        return families.load(nequip_shape("M"), "cpu", patch=True)
    from cgforge.plugin.runtime.bundled import model_path

    return families.load(model_path(name.removeprefix("bundled-")), "cpu", "float32", patch=True)


def cutoff_of(model: torch.nn.Module) -> float:
    """The model's cutoff, as cgforge's runtime reads it (the family's adapter)."""
    from cgforge.patches import families

    return families.family_of(model).adapter(model, torch.device("cpu")).cutoff


def water_edges(atoms: int, cutoff: float) -> tuple[int, int]:
    """(nodes, edges) of ``water_box(n_molecules=atoms // 3)`` at ``cutoff``, counted on the CPU."""
    from cgforge.plugin.runtime.neighbours import neighbour_list
    from cgforge.plugin.water import water_box

    box = water_box(n_molecules=max(atoms // 3, 1))
    pos = torch.tensor(box.positions, dtype=torch.float64)
    cell = torch.tensor(np.array(box.cell), dtype=torch.float64)
    sender, _, _ = neighbour_list(pos, cell, tuple(bool(p) for p in box.pbc), cutoff)
    return len(box), int(sender.shape[0])


# ---------------------------------------------------------------------------------------------------------------
# Counting


def linear_macs(irreps_in, irreps_out) -> int:
    """Multiply-adds per node of a linear map between irreps: every pair of equal irreps, mul_in x mul_out x dim."""
    return sum(a.mul * b.mul * a.ir.dim for a in irreps_in for b in irreps_out if a.ir == b.ir)


def _walk(module: torch.nn.Module, path: str = "", parent: torch.nn.Module | None = None
          ) -> Iterator[tuple[str, str, torch.nn.Module, torch.nn.Module | None]]:
    """(kind, path, module, parent) of every module this script prices; a priced module's children are not walked."""
    from cgforge.patches.mace import SymmetricContraction

    name = path.rpartition(".")[2]
    cls = type(module).__name__
    kind = None
    if isinstance(getattr(module, "conv", None), Convolution):
        kind = "convolution"
    elif isinstance(module, SymmetricContraction):
        kind = "symmetric contraction"
    elif name in ("conv_tp_weights", "edge_mlp"):
        kind = "radial"
    elif cls in ("SphericalHarmonics", "KernelHarmonics"):  # e3nn's module, or cgforge's kernel standing in for it
        kind = "spherical harmonics"
    elif isinstance(module, torch.nn.Embedding):
        kind = "embedding"
    elif cls == "SpeciesSelfConnection":
        kind = "self-connection"
    elif cls in ("Linear", "SplitLinear") and hasattr(module, "irreps_in") and hasattr(module, "irreps_out"):
        kind = "linear"
    elif hasattr(module, "in_features") and hasattr(module, "out_features"):
        kind = "scalar linear"
    if kind is not None:
        yield kind, path, module, parent
        return
    for child_name, child in module.named_children():
        yield from _walk(child, f"{path}.{child_name}" if path else child_name, module)


def _chain(shapes: list[tuple[int, int]]) -> list[int]:
    """The widths w0 -> w1 -> ... of an MLP from its weight matrices' shapes (either orientation)."""
    a, b = shapes[0]
    chain = [b, a] if len(shapes) > 1 and a in shapes[1] and b not in shapes[1] else [a, b]
    for shape in shapes[1:]:
        chain.append(shape[1] if shape[0] == chain[-1] else shape[0])
    return chain


def _layer(path: str) -> str:
    match = re.search(r"(?:interactions|products|readouts)\.(\d+)|layer(\d+)_convnet", path)
    return next(g for g in match.groups() if g is not None) if match else "-"


def _no_backward(path: str, parent: torch.nn.Module | None) -> bool:
    """True for the stages whose input does not depend on the positions: the embedding, and in the first layer
    the linear and the self-connection on the embedded features (MACE's residual blocks, NequIP's ``sc``)."""
    if "node_embedding" in path or "type_embed" in path:
        return True
    if _layer(path) != "0" or "readout" in path:
        return False
    name = path.rpartition(".")[2]
    if name in ("linear_up", "linear_1") or name == "sc":
        return True
    return name == "skip_tp" and "Residual" in type(parent).__name__


def stages(model: torch.nn.Module, nodes: int, edges: int, radial: str = "table") -> list[Row]:
    """The rows of one force step of the patched ``model`` on ``nodes`` atoms and ``edges`` edges (unfloored)."""
    rows: dict[tuple[str, str], Row] = {}

    def row(stage: str, layer: str) -> Row:
        return rows.setdefault((stage, layer), Row(stage, layer))

    edge_rows = [row("edge geometry", "-"), row("spherical harmonics", "-")]
    if radial == "mlp":
        edge_rows.append(row("radial basis", "-"))
    convs, sh_dim, basis = 0, 0, 0
    for kind, path, module, parent in _walk(model):
        layer = _layer(path)
        grad = not _no_backward(path, parent)
        if kind == "convolution":
            p = module.conv.problem
            f = layer_floor(p, nodes, edges, bandwidth=1.0, tflops=1e-12)  # ms at 1 B/s, 1 FLOP/s: bytes, FLOPs
            fb_bytes, fb_flops = f["floor_fb_bytes_ms"] / 1e3, f["floor_fb_flops_ms"] / 1e3
            fwd_bytes, fwd_flops = f["floor_fwd_bytes_ms"] / 1e3, f["floor_fwd_flops_ms"] / 1e3
            row("convolution", layer).add(2, fwd_bytes, fb_bytes - fwd_bytes, fwd_flops, fb_flops - fwd_flops)
            convs += 1
            if radial == "table":  # the cubics of every weight, per edge, forward and backward: L2 reads
                row("radial weights (table in conv)", layer).add(0, 0, 0, 0, 0)
                row("convolution", layer).l2_reread += 2 * edges * module.conv.weight_numel * CUBIC * ITEM
            else:  # the conv reads W and writes grad W where layer_floor counts the length and grad r
                w = module.conv.weight_numel
                row("radial weights (MLP)", layer).add(0, edges * (w - 1) * ITEM, edges * (w - 1) * ITEM, 0, 0)
        elif kind == "radial":
            if radial == "table":
                continue
            chain = _chain([tuple(t.shape) for t in module.parameters() if t.dim() == 2])
            basis = basis or chain[0]
            macs = sum(a * b for a, b in zip(chain, chain[1:]))
            widths = sum(a + b for a, b in zip(chain, chain[1:]))  # each GEMM's input read, output written once
            hidden = sum(chain[1:-1])  # pre-activations, re-read by the backward
            row("radial weights (MLP)", layer).add(2 * (len(chain) - 1), edges * widths * ITEM,
                                                   edges * (widths + hidden) * ITEM, 2 * macs * edges,
                                                   2 * macs * edges)
        elif kind == "symmetric contraction":
            from cgforge.kernels.symmetric_contraction.program import backward_program, forward_program

            # floors() gives ms at a bandwidth: at 1000 B/s its ms are the bytes
            f = sc_floors(module, nodes, torch.float32, bandwidth=1e3)
            p, tuning = module.problem, module.tuning
            fwd_macs = forward_program(module.schedule, tuning).multiply_adds()
            bwd_macs = backward_program(module.schedule, grad_weights=False, tuning=tuning).multiply_adds()
            row("symmetric contraction", layer).add(2, f["floor_fwd"], f["floor_fb"] - f["floor_fwd"],
                                                    2 * nodes * p.channels * fwd_macs,
                                                    2 * nodes * p.channels * bwd_macs)
        elif kind == "spherical harmonics":
            sh_dim = module.irreps_out.dim
        elif kind == "embedding":
            row("node embedding", "-").add(1, nodes * (INDEX + module.embedding_dim * ITEM), 0, 0, 0)
        else:
            if kind == "scalar linear":
                d_in, d_out, macs = module.in_features, module.out_features, module.in_features * module.out_features
            else:
                i_in = module.irreps_in1 if kind == "self-connection" else module.irreps_in
                d_in, d_out, macs = i_in.dim, module.irreps_out.dim, linear_macs(i_in, module.irreps_out)
            stage = ("node embedding" if "node_embedding" in path else "readout" if "readout" in path
                     else "self-connection" if kind == "self-connection" else "node-wise linears")
            nbytes, flops = nodes * (d_in + d_out) * ITEM, 2 * macs * nodes
            row(stage, "-" if stage == "node embedding" else layer).add(
                1 + grad, nbytes, nbytes if grad else 0, flops, flops if grad else 0)
    if not convs or not sh_dim:
        raise ValueError(f"{type(model).__name__}: found {convs} convolutions and spherical harmonics of dim "
                         f"{sh_dim}; expected a patched MACE or NequIP model")
    # edge vectors and lengths: fwd read 2 indices, write vector + length; bwd read grad vector, each layer's
    # grad r, the vector and the length, the transposed order, write the forces (positions once each way)
    edge_rows[0].add(2, edges * (2 * INDEX + 4 * ITEM) + nodes * 3 * ITEM,
                     edges * ((3 + convs + 3 + 1) * ITEM + INDEX) + nodes * (3 * ITEM + 2 * INDEX), 0, 0)
    edge_rows[1].add(2, edges * (3 + sh_dim) * ITEM, edges * (convs * sh_dim + 3 + 3) * ITEM, 0, 0)
    if radial == "mlp":
        edge_rows[2].add(2, edges * (1 + basis) * ITEM, edges * (convs * basis + 1 + 1) * ITEM, 0, 0)
    return list(rows.values())


def row_floor(r: Row, bandwidth: float, tflops: float, l2_bandwidth: float = math.inf) -> tuple[float, str]:
    """(ms, bound) of one row: the largest of its DRAM bytes at ``bandwidth`` (B/s, bound 'bytes'), its L2 bytes
    at ``l2_bandwidth`` (B/s, 'l2'; inf: not counted) and its FLOPs at ``tflops`` ('flops')."""
    terms = {"bytes": r.bytes / bandwidth * 1e3, "l2": r.l2_bytes / l2_bandwidth * 1e3,
             "flops": r.flops / (tflops * 1e12) * 1e3}
    bound = max(terms, key=lambda k: (terms[k], k == "bytes"))  # a tie goes to DRAM, as before the L2 term
    return terms[bound], bound


def floor(rows: list[Row], bandwidth: float, tflops: float, l2_bandwidth: float = math.inf) -> float:
    """Set each row's floor (ms) and bound (``row_floor``); returns the total."""
    for r in rows:
        r.floor_ms, r.bound = row_floor(r, bandwidth, tflops, l2_bandwidth)
    return sum(r.floor_ms for r in rows)


def step_floor(name: str, atoms: int, bandwidth: float, tflops: float, radial: str = "table",
               model: torch.nn.Module | None = None, l2_bandwidth: float = math.inf,
               beside: tuple[Rates, ...] = ()) -> dict:
    """Everything the script prints, as a dict: the system, the rows and the total floor (ms) at ``bandwidth``,
    ``tflops`` and ``l2_bandwidth`` (B/s; inf: no L2 term), and per rate set of ``beside`` its rows' floors and
    total (``beside``: name -> {rates, row_floor_ms, total_floor_ms})."""
    model = load_model(name) if model is None else model
    cutoff = cutoff_of(model)
    nodes, edges = water_edges(atoms, cutoff)
    rows = stages(model, nodes, edges, radial)
    total = floor(rows, bandwidth, tflops, l2_bandwidth)
    others = {}
    for rates in beside:
        floors = [row_floor(r, rates.hbm_gbs * 1e9, rates.tflops, rates.l2_gbs * 1e9) for r in rows]
        others[rates.name] = {"rates": asdict(rates), "row_floor_ms": [f[0] for f in floors],
                              "row_bound": [f[1] for f in floors], "total_floor_ms": sum(f[0] for f in floors)}
    return {"model": name, "nodes": nodes, "edges": edges, "cutoff": cutoff, "radial": radial,
            "bandwidth_gbs": bandwidth / 1e9, "tflops": tflops, "l2_gbs": l2_bandwidth / 1e9,
            "total_floor_ms": total, "total_bytes": sum(r.bytes for r in rows),
            "total_l2_bytes": sum(r.l2_bytes for r in rows), "total_flops": sum(r.flops for r in rows),
            "rows": [asdict(r) | {"l2_bytes": r.l2_bytes} for r in rows], "beside": others}


def rates_named(names: str) -> tuple[Rates, ...]:
    """``--beside``'s rate sets: comma-separated ``KNOWN_RATES`` keys or ``device`` (this machine's GPU)."""
    out = []
    for name in filter(None, (n.strip().lower() for n in names.split(","))):
        if name == "device":
            if not torch.cuda.is_available():
                raise ValueError("--beside device: no CUDA device here")
            out.append(device_rates())
        elif name in KNOWN_RATES:
            out.append(KNOWN_RATES[name])
        else:
            raise ValueError(f"--beside {name!r}: unknown; choices: {', '.join([*KNOWN_RATES, 'device'])}")
    return tuple(out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    h100 = KNOWN_RATES["h100"]
    parser.add_argument("--model", default="mace-mp-medium", help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--atoms", type=int, default=5184, help="atoms: water_box(n_molecules=ATOMS // 3)")
    parser.add_argument("--bandwidth-gbs", type=float, default=H100_SXM_GBS,
                        help="DRAM bandwidth, GB/s (default: the H100 SXM data sheet's 3350)")
    parser.add_argument("--tflops", type=float, default=FP32_PEAK_TFLOPS["H100"],
                        help="FP32 (non-tensor) peak, TFLOP/s (default: H100 SXM, 66.9)")
    parser.add_argument("--l2-gbs", type=float, default=h100.l2_gbs,
                        help=f"L2 bandwidth, GB/s (default: the H100 estimate of KNOWN_RATES, {h100.l2_gbs:.0f}); "
                             "inf: no L2 term")
    parser.add_argument("--beside", default="h200",
                        help="rate sets whose floors are printed beside: h100, h200, device (this GPU); '' none")
    parser.add_argument("--radial", choices=("table", "mlp"), default="table",
                        help="radial weights: tables read in the convolution (FP32 CUDA default) or the MLP")
    args = parser.parse_args(argv)
    if args.model not in MODELS:
        parser.error(f"--model {args.model!r}: unknown; choices: {', '.join(MODELS)}")
    if args.atoms < 3 or not args.bandwidth_gbs > 0 or not args.tflops > 0 or not args.l2_gbs > 0:
        parser.error("--atoms must be >= 3, --bandwidth-gbs, --tflops and --l2-gbs > 0")
    try:
        beside = rates_named(args.beside)
    except ValueError as error:
        parser.error(str(error))
    result = step_floor(args.model, args.atoms, args.bandwidth_gbs * 1e9, args.tflops, args.radial,
                        l2_bandwidth=args.l2_gbs * 1e9, beside=beside)
    print(f"{args.model}: {result['nodes']} atoms, {result['edges']} edges at {result['cutoff']} Å; radial "
          f"{args.radial}; floor = max(bytes at {args.bandwidth_gbs:.0f} GB/s, L2 bytes at {args.l2_gbs:.0f} GB/s, "
          f"FLOPs at {args.tflops} TFLOP/s) per row, forward + backward")
    for rates in beside:
        print(f"beside: {rates.name}: {rates.hbm_gbs:.0f} GB/s, L2 {rates.l2_gbs:.0f} GB/s, {rates.tflops:.1f} "
              f"TFLOP/s; " + "; ".join(f"{k}: {v}" for k, v in rates.sources))
    names = list(result["beside"])
    print(f"{'stage':32s} {'layer':>5s} {'kernels':>7s} {'MB':>10s} {'L2 MB':>10s} {'GFLOP':>9s} {'floor ms':>9s} "
          f"{'bound':5s}" + "".join(f" {n[:14]:>14s}" for n in names))
    for i, r in enumerate(result["rows"]):
        print(f"{r['stage']:32s} {r['layer']:>5s} {r['kernels']:7d} {(r['fwd_bytes'] + r['bwd_bytes']) / 1e6:10.1f} "
              f"{r['l2_bytes'] / 1e6:10.1f} {(r['fwd_flops'] + r['bwd_flops']) / 1e9:9.2f} {r['floor_ms']:9.4f} "
              f"{r['bound']:5s}" + "".join(f" {result['beside'][n]['row_floor_ms'][i]:9.4f} "
                                            f"{result['beside'][n]['row_bound'][i]:>4s}" for n in names))
    print(f"{'total':32s} {'':>5s} {sum(r['kernels'] for r in result['rows']):7d} {result['total_bytes'] / 1e6:10.1f} "
          f"{result['total_l2_bytes'] / 1e6:10.1f} {result['total_flops'] / 1e9:9.2f} {result['total_floor_ms']:9.4f} "
          f"{'':5s}" + "".join(f" {result['beside'][n]['total_floor_ms']:9.4f}     " for n in names))
    result["environment"] = environment()
    path = write_json("step-floor", result)
    print(f"JSON: {path}")
    return result


if __name__ == "__main__":
    main()
