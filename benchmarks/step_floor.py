"""The hardware floor of one whole MD force step (energy + forces: forward + backward), stage by stage (CPU).

    python benchmarks/step_floor.py [--model mace-mp-medium] [--atoms 5184] [--bandwidth-gbs 3350] [--tflops 66.9]
        [--radial table|mlp]

Models: ``mace-mp-medium`` (shapes.mace_mp_shape, FP32), ``bundled-mace`` and ``bundled-nequip`` (the bundled water
models), ``nequip-M`` (shapes.nequip_shape("M")). The system is ``water_box(n_molecules=atoms // 3)``; its edges
are counted exactly by ``neighbour_list`` at the model's cutoff. The model is patched on the CPU (the kernel
objects exist without a GPU) and its modules are walked: each stage below is priced from the patched module's own
problem or irreps. Nothing runs on a GPU, so a GPU run can print this floor beside the step it measures.

What is counted, per stage (one row per stage and layer; FP32, 4-byte items, 4-byte indices):

- a row's bytes are what its kernels must read and write in DRAM, forward + backward, each input read once and each
  output written once; its FLOPs are 2 per multiply-add of its arithmetic, forward + backward. Its floor is
  max(bytes / bandwidth, FLOPs / peak) for the row as a whole; the step's floor is the sum of the rows' floors
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
SXM data sheet's HBM3 bandwidth (bench_layer measures a copy instead), and 66.9 TFLOP/s, bench_layer's FP32 peak
for H100/H200. Prints the table and the total; JSON goes to benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
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
    floor_ms: float = 0.0
    bound: str = ""

    @property
    def bytes(self) -> float:
        return self.fwd_bytes + self.bwd_bytes

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
            if radial == "table":
                row("radial weights (table in conv)", layer).add(0, 0, 0, 0, 0)
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


def floor(rows: list[Row], bandwidth: float, tflops: float) -> float:
    """Set each row's floor (ms) and bound from ``bandwidth`` (B/s) and ``tflops``; returns the total."""
    for r in rows:
        by_bytes, by_flops = r.bytes / bandwidth * 1e3, r.flops / (tflops * 1e12) * 1e3
        r.floor_ms, r.bound = max(by_bytes, by_flops), ("flops" if by_flops > by_bytes else "bytes")
    return sum(r.floor_ms for r in rows)


def step_floor(name: str, atoms: int, bandwidth: float, tflops: float, radial: str = "table",
               model: torch.nn.Module | None = None) -> dict:
    """Everything the script prints, as a dict: the system, the rows and the total floor (ms)."""
    model = load_model(name) if model is None else model
    cutoff = cutoff_of(model)
    nodes, edges = water_edges(atoms, cutoff)
    rows = stages(model, nodes, edges, radial)
    total = floor(rows, bandwidth, tflops)
    return {"model": name, "nodes": nodes, "edges": edges, "cutoff": cutoff, "radial": radial,
            "bandwidth_gbs": bandwidth / 1e9, "tflops": tflops, "total_floor_ms": total,
            "total_bytes": sum(r.bytes for r in rows), "total_flops": sum(r.flops for r in rows),
            "rows": [asdict(r) for r in rows]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mace-mp-medium", help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--atoms", type=int, default=5184, help="atoms: water_box(n_molecules=ATOMS // 3)")
    parser.add_argument("--bandwidth-gbs", type=float, default=H100_SXM_GBS,
                        help="DRAM bandwidth, GB/s (default: the H100 SXM data sheet's 3350)")
    parser.add_argument("--tflops", type=float, default=FP32_PEAK_TFLOPS["H100"],
                        help="FP32 (non-tensor) peak, TFLOP/s (default: H100 SXM, 66.9)")
    parser.add_argument("--radial", choices=("table", "mlp"), default="table",
                        help="radial weights: tables read in the convolution (FP32 CUDA default) or the MLP")
    args = parser.parse_args(argv)
    if args.model not in MODELS:
        parser.error(f"--model {args.model!r}: unknown; choices: {', '.join(MODELS)}")
    if args.atoms < 3 or not args.bandwidth_gbs > 0 or not args.tflops > 0:
        parser.error("--atoms must be >= 3, --bandwidth-gbs and --tflops > 0")
    result = step_floor(args.model, args.atoms, args.bandwidth_gbs * 1e9, args.tflops, args.radial)
    print(f"{args.model}: {result['nodes']} atoms, {result['edges']} edges at {result['cutoff']} Å; radial "
          f"{args.radial}; floor = max(bytes at {args.bandwidth_gbs:.0f} GB/s, FLOPs at {args.tflops} TFLOP/s) "
          "per row, forward + backward")
    print(f"{'stage':32s} {'layer':>5s} {'kernels':>7s} {'MB':>10s} {'GFLOP':>9s} {'floor ms':>9s}  bound")
    for r in result["rows"]:
        print(f"{r['stage']:32s} {r['layer']:>5s} {r['kernels']:7d} {(r['fwd_bytes'] + r['bwd_bytes']) / 1e6:10.1f} "
              f"{(r['fwd_flops'] + r['bwd_flops']) / 1e9:9.2f} {r['floor_ms']:9.4f}  {r['bound']}")
    print(f"{'total':32s} {'':>5s} {sum(r['kernels'] for r in result['rows']):7d} {result['total_bytes'] / 1e6:10.1f} "
          f"{result['total_flops'] / 1e9:9.2f} {result['total_floor_ms']:9.4f}")
    result["environment"] = environment()
    path = write_json("step-floor", result)
    print(f"JSON: {path}")
    return result


if __name__ == "__main__":
    main()
