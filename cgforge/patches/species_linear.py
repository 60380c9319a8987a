"""Self-connections whose second input depends on the species only: one linear map per species.

MACE's ``skip_tp`` and NequIP's ``sc`` are e3nn ``FullyConnectedTensorProduct``s of node features x with node
attributes a: out[n, w] = sum over paths of pw * sum_{u, v} W[u, v, w] x[n, u] a[n, v] (a scalar). Where every node
of a species has the same attributes, out[n] = x[n] M_s(n) with M_s = pw * sum_v a_s[v] W[:, v, :] made once per
species. Only the caller knows which nodes share attributes: cgforge's calculator says so
(``CallGraphCache.species``); every other call takes e3nn's path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from e3nn import o3

from cgforge.kernels.irreps_linear import IrrepsMap, LinearLaunch, apply_map, tile_rows, transpose_blocks

from . import e3nn_layers, stand_in
from .stand_in import StandIn, checked
from .torch_internals import adopt, give_back, tensor_version


@dataclass(frozen=True)
class SpeciesGroups:
    """Nodes grouped by species: ``order`` lists node indices species by species (``counts[k]`` of the k-th
    present), ``inverse[n]`` the place of node n in ``order``, ``representatives[k]`` one node of the k-th species.
    From ``from_species`` (a host read) or ``SpeciesRoom`` (``counts``: the rooms; unused places repeat node 0)."""

    order: torch.Tensor
    inverse: torch.Tensor
    counts: tuple[int, ...]
    representatives: torch.Tensor
    num_nodes: int
    padded: bool = False  # SpeciesRoom's: slots past a species' count repeat node 0 (gather their outputs, never)
    # The self-connections' kernel launches for these groups (their blocks are a function of the weights and the
    # species), one entry per module, made by an eager call and reused by later ones and by a capture: they live
    # as long as the groups, and a capture is invalidated when the species groups change.
    launch_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_species(cls, species: torch.Tensor) -> SpeciesGroups:
        """From a [N] integer species index per node."""
        if species.dim() != 1 or species.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"species: expected a 1-D integer tensor, got {species.dtype} with shape "
                            f"{list(species.shape)}")
        species = species.long()
        order = torch.argsort(species, stable=True)
        present, counts = torch.unique_consecutive(species.index_select(0, order), return_counts=True)
        counts_host = tuple(int(c) for c in counts.tolist())
        starts = torch.cumsum(counts, 0) - counts
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return cls(order, inverse, counts_host, order.index_select(0, starts), int(species.numel()))


class SpeciesRoom:
    """Fixed room per species, for grouping nodes inside a captured CUDA graph (no host read): ``capacities[k]``
    slots for species k (0: no group), padded with node 0; nodes past ``num_valid`` belong to no group."""

    def __init__(self, capacities: Sequence[int], device: torch.device | str) -> None:
        self.capacities = tuple(int(c) for c in capacities)
        if any(c < 0 for c in self.capacities) or not any(self.capacities):
            raise ValueError(f"capacities: expected non-negative counts, one positive at least, got {capacities}")
        present = [k for k, c in enumerate(self.capacities) if c]
        self.sizes = tuple(self.capacities[k] for k in present)
        self.total = sum(self.sizes)
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        # Device constants made here, outside any capture (a tensor from host values is a host-to-device copy).
        kw = {"dtype": torch.int64, "device": torch.device(device)}
        self._species = torch.tensor(present, **kw)
        self._starts = torch.tensor(starts, **kw)
        self._sizes = torch.tensor(self.sizes, **kw)

    def fits(self, counts: Sequence[int]) -> bool:
        """Whether every species' count (one per species, as ``groups`` returns them) fits its room."""
        return len(counts) == len(self.capacities) and all(n <= c for n, c in zip(counts, self.capacities))

    def groups(self, species: torch.Tensor, num_valid: torch.Tensor) -> tuple[SpeciesGroups, torch.Tensor]:
        """The groups of the first ``num_valid`` (a device scalar) of [N] species indices and each species' count
        (int64; one above its room leaves the overflow out: the caller checks ``fits``). No host reads, no sort."""
        n, device, k = species.shape[0], species.device, len(self.capacities)
        node = torch.arange(n, device=device)
        index = torch.where(node < num_valid, species.long(), k)  # padding nodes: past every species
        counts = torch.zeros(k + 1, dtype=torch.int64, device=device).index_add_(0, index, torch.ones_like(index))
        member = index[:, None] == self._species[None, :]  # [N, groups]: at most one per row
        rank = _running_counts(member) - 1  # place among the nodes of its species so far
        placed = (member & (rank < self._sizes)).any(1)
        slot = ((self._starts + rank) * member).sum(1)
        dump = torch.full((), self.total, dtype=torch.int64, device=device)  # writes that must not land
        order = torch.zeros(self.total + 1, dtype=torch.int64, device=device)
        order.index_copy_(0, torch.where(placed, slot, dump), node)
        order = order[:self.total]
        inverse = torch.where(placed, slot, torch.zeros_like(slot))  # others read slot 0: finite, never summed
        groups = SpeciesGroups(order, inverse, self.sizes, order.index_select(0, self._starts), n, padded=True)
        return groups, counts[:k]


def _running_counts(member: torch.Tensor) -> torch.Tensor:
    """``torch.cumsum(member, 0)`` of a bool [N, G] as int64, with one scan of the G*N entries laid out group by
    group (torch scans a dim-0 cumsum of a few columns with one thread per column)."""
    n, g = member.shape
    if n == 0 or g == 0:
        return torch.zeros(n, g, dtype=torch.int64, device=member.device)
    running = torch.cumsum(member.t().reshape(-1).to(torch.int64), 0).view(g, n)  # counts earlier groups' too
    before = torch.cat([running.new_zeros(1), running[:-1, -1]])  # the earlier groups' totals
    return (running - before[:, None]).t()


class SpeciesSelfConnection(torch.nn.Module, StandIn):
    """An e3nn ``FullyConnectedTensorProduct`` (shared internal weights, scalar second input), computed per species
    where the caller has said which nodes share their attributes, else by the e3nn module; the same state_dict."""

    kernel_max_channels = e3nn_layers.DEFAULT_KERNEL_MAX_CHANNELS  # the class's: modules pickled before it was set

    def __init__(self, tp: torch.nn.Module, graphs: object,
                 kernel_max_channels: int = e3nn_layers.DEFAULT_KERNEL_MAX_CHANNELS) -> None:
        super().__init__()
        adopt(self, tp, children=True)
        self.kernel_max_channels = int(kernel_max_channels)
        self.irreps_in1, self.irreps_in2, self.irreps_out = (
            o3.Irreps(tp.irreps_in1), o3.Irreps(tp.irreps_in2), o3.Irreps(tp.irreps_out))
        self.in1_dims = [mul_ir.dim for mul_ir in self.irreps_in1]
        self.out_dims = [mul_ir.dim for mul_ir in self.irreps_out]
        in2_slices = self.irreps_in2.slices()
        # (i_in1, i_out, in2 slice, weight offset, (u, v, w), path weight x CG of (l, 0, l)) per path
        self.paths: list[tuple[int, int, slice, int, tuple[int, int, int], float]] = []
        offset = 0
        for ins in tp.instructions:
            l1 = self.irreps_in1[ins.i_in1].ir.l
            cg = float(o3.wigner_3j(l1, 0, l1, dtype=torch.float64)[0, 0, 0])  # = 1/sqrt(2l+1)
            u, v, w = ins.path_shape
            self.paths.append((ins.i_in1, ins.i_out, in2_slices[ins.i_in2], offset, (u, v, w),
                               float(ins.path_weight) * cg))
            offset += u * v * w
        self.graphs = graphs
        self.original = (tp,)

    @classmethod
    def supports(cls, tp: torch.nn.Module) -> bool:
        instructions = getattr(tp, "instructions", None)
        weight = getattr(tp, "weight", None)
        return (instructions is not None and getattr(tp, "internal_weights", False)
                and getattr(tp, "shared_weights", False) and isinstance(weight, torch.Tensor) and weight.dim() == 1
                and all(mul_ir.ir.l == 0 for mul_ir in o3.Irreps(tp.irreps_in2))
                and all(ins.connection_mode == "uvw" and ins.has_weight and len(ins.path_shape) == 3
                        for ins in instructions)
                and sum(u * v * w for u, v, w in (ins.path_shape for ins in instructions)) == weight.numel())

    @classmethod
    def wrap(cls, tp: torch.nn.Module, graphs: object, where: str = "") -> SpeciesSelfConnection | None:
        """The stand-in if ``tp`` is supported and passes ``stand_in.checked``, else None (keep e3nn's)."""
        return checked(cls(tp, graphs), where) if cls.supports(tp) else None

    def forward(self, x: torch.Tensor, attrs: torch.Tensor) -> torch.Tensor:
        groups = getattr(self.graphs, "species", None)
        if groups is None or x.dim() != 2 or attrs.dim() != 2 or x.shape[0] != groups.num_nodes \
                or attrs.shape[0] != groups.num_nodes:
            return self._e3nn(x, attrs)
        return self._per_species(x, attrs, groups)

    def _e3nn(self, x: torch.Tensor, attrs: torch.Tensor) -> torch.Tensor:
        (tp,) = self.original
        return give_back(self, tp, deep=False)(x, attrs)  # its submodules are ours: only its own tensors

    def species_matrices(self, attrs_rows: torch.Tensor) -> list[torch.Tensor]:
        """Per path, the [K, u, w] matrices of K attribute rows [K, dim in2]."""
        mats = []
        for _, _, in2, offset, (u, v, w), scale in self.paths:
            weight = self.weight.narrow(0, offset, u * v * w).view(u, v, w)
            mats.append(torch.einsum("uvw,kv->kuw", weight, attrs_rows[:, in2]) * scale)
        return mats

    def _per_species(self, x: torch.Tensor, attrs: torch.Tensor, groups: SpeciesGroups) -> torch.Tensor:
        launches = self._kernel_launches(x, attrs, groups)
        if launches is not None:
            return apply_map(x, self.irreps_map(), *launches)
        mats = self.species_matrices(attrs.index_select(0, groups.representatives))
        grouped = x.index_select(0, groups.order).split(list(groups.counts))
        outs = []
        for k, xk in enumerate(grouped):
            pieces = xk.split(self.in1_dims, dim=1) if len(self.in1_dims) > 1 else (xk,)
            blocks: list[torch.Tensor | None] = [None] * len(self.out_dims)
            for (i_in1, i_out, _, _, (u, _, w), _), mat in zip(self.paths, mats):
                y = e3nn_layers.path_matmul(pieces[i_in1], u, mat[k], w)
                blocks[i_out] = y if blocks[i_out] is None else blocks[i_out] + y
            outs.append(e3nn_layers.cat_irreps(blocks, self.out_dims, xk))
        return torch.cat(outs).index_select(0, groups.inverse)

    def __getstate__(self) -> dict:
        """The module's state without the kernel's device tables (remade on first use: pickles name no more)."""
        state = dict(super().__getstate__())
        state.pop("_kernel_arrays", None)
        return state

    def irreps_map(self) -> IrrepsMap:
        """The per-species map's shape for the irreps_linear kernel (a species' blocks: its ``species_matrices``)."""
        return IrrepsMap.of(self.irreps_in1, self.irreps_out, self.paths)

    def takes_kernel(self, dtype: torch.dtype) -> bool:
        """Whether the map's blocks are narrow enough for the irreps_linear kernel (``kernel_max_channels``) and the
        kernel takes this dtype and width."""
        m = self.irreps_map()
        return m.widest_block <= self.kernel_max_channels and tile_rows(m, dtype) is not None

    def _kernel_launches(self, x: torch.Tensor, attrs: torch.Tensor, groups: SpeciesGroups
                         ) -> tuple[list[LinearLaunch], list[LinearLaunch]] | None:
        """The irreps_linear kernel's launches, one per species each way, or None where the GEMMs run (off CUDA,
        gradients, torch.compile, padded groups, maps or dtypes the kernel does not take). Kept in
        ``groups.launch_cache`` per weight and attribute version (not while capturing: its kernels do not run)."""
        if (x.device.type != "cuda" or groups.padded or torch.compiler.is_compiling() or not self.paths
                or (torch.is_grad_enabled() and (self.weight.requires_grad or attrs.requires_grad))):
            return None
        if not self.takes_kernel(x.dtype):
            return None  # before the species matrices are made
        w = self.weight
        key = (w.data_ptr(), tensor_version(w), attrs.data_ptr(), tensor_version(attrs), x.dtype, x.device)
        cached = groups.launch_cache.get(id(self))  # one entry a module: the cache cannot grow call by call
        if cached is not None and cached[0] == key:
            return cached[1]
        mats = self.species_matrices(attrs.index_select(0, groups.representatives))
        launches = self.species_launches(x.dtype, x.device, groups, mats)
        if not torch.cuda.is_current_stream_capturing():
            groups.launch_cache[id(self)] = (key, launches)
        return launches

    def species_launches(self, dtype: torch.dtype, device: torch.device, groups: SpeciesGroups,
                         mats: list[torch.Tensor]) -> tuple[list[LinearLaunch], list[LinearLaunch]] | None:
        """``_kernel_launches``'s value, made on any device (tests check it on the CPU)."""
        if not self.takes_kernel(dtype):
            return None
        m = self.irreps_map()
        cached = getattr(self, "_kernel_arrays", None)
        if cached is None or cached[0] != device:
            cached = self._kernel_arrays = (device, m.arrays(device), m.transpose().arrays(device))
        _, arrays, arrays_t = cached
        blocks = torch.cat([mat.reshape(mat.shape[0], -1) for mat in mats], dim=1).to(dtype)  # [species, numel]
        blocks_t = transpose_blocks(m, blocks)
        forward, backward, start = [], [], 0
        for k, count in enumerate(groups.counts):
            rows = groups.order[start:start + count]
            forward.append(LinearLaunch(arrays, blocks[k], rows, count))
            backward.append(LinearLaunch(arrays_t, blocks_t[k], rows, count))
            start += count
        return forward, backward

    def self_check(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Both paths against e3nn on 9 random nodes of 3 species (attribute rows random per species)."""
        species = torch.tensor([2, 0, 1, 0, 2, 2, 1, 0, 0], device=self.weight.device)
        attrs = self.random(generator, 3, self.irreps_in2.dim).index_select(0, species)
        x = self.random(generator, species.numel(), self.irreps_in1.dim)
        return self._per_species(x, attrs, SpeciesGroups.from_species(species)), self._e3nn(x, attrs)

    def extra_repr(self) -> str:
        return f"{self.irreps_in1} x {self.irreps_in2} -> {self.irreps_out}, per species when grouped"


def swap_in(model: torch.nn.Module, attribute: str, graphs: object,
            kernel_max_channels: int = e3nn_layers.DEFAULT_KERNEL_MAX_CHANNELS) -> int:
    """Replace the ``attribute`` child (``skip_tp``, ``sc``) of every module of ``model`` by its checked stand-in,
    in place; returns how many."""

    def make(where: str, child: torch.nn.Module) -> StandIn | None:
        if where.rpartition(".")[2] != attribute:
            return None
        if isinstance(child, SpeciesSelfConnection):
            child.graphs = graphs  # patched before: the model's cache now
            return None
        if not SpeciesSelfConnection.supports(child):
            return None
        return SpeciesSelfConnection(child, graphs, kernel_max_channels)

    return len(stand_in.swap_in(model, make))


def swap_out(model: torch.nn.Module) -> int:
    """Put the e3nn originals back. In place; returns how many."""
    return stand_in.swap_out(model, (SpeciesSelfConnection,))
