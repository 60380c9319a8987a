"""Tuning values: every knob of the kernels as plain frozen dataclasses, passed down as ``tuning=`` (None: the
defaults). Nothing here reads the environment, and no environment variable changes a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

LOOP_ORDERS = ("auto", "segments", "edges", "chunks")
PAIRINGS = ("pq", "pd", "qd")


class _Knobs:
    def describe(self) -> str:
        """Every knob and its value, one line (what ``cgforge doctor`` prints)."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class TPTuning(_Knobs):
    """Tensor product and convolution kernels.

    forward_chunk / backward_chunk: largest channel chunk per segment (a multiple of 32; None: the defaults of
    ``schedule.default_chunks``). loop_order, in a row with several edges: ``segments`` walks the edges once per
    segment, ``edges`` once for every segment, ``chunks`` once per channel chunk; ``auto`` picks per direction
    (``Schedule.loop_order``); backward_loop_order: the backward's own (None: ``loop_order``'s).
    backward_min_blocks: the B of the CSR backward's ``__launch_bounds__(threads, B)``: ``auto``
    (``core.occupancy.choose_min_blocks``), 0 none, or that bound. single_irrep_backward_chunk: the backward chunk of
    an FP32 CSR kernel whose in1 has one irrep (None: the general rule). backward_chunk_passes: a chunks-order CSR
    backward may run one launch per chunk (``Schedule.backward_passes``). backward_range_bytes: gradient bytes per
    range of receiver rows in a first-order backward of ``Convolution.forward_table_rows`` (None: all at once).
    max_blocks: the most blocks of one launch (None: CUDA's limit). Neither of the last two changes a kernel's source.
    receiver_backward_min_row_bytes: a table convolution whose x needs no gradient and whose grad-out rows are at least
    this wide runs a backward that walks the forward's rows (None: never). receiver_backward_atomic: that walk also
    where x needs a gradient, grad x added with float atomics (bits vary from run to run; docs/calculator.md).
    receiver_backward_fixed_point: the same walk with grad x added in 64-bit fixed point (``convolution.fixed_point``),
    FP32 only; ``auto``: where the grad-out rows exceed the device's L2 and the int64 sums take at most
    fixed_point_max_bytes. row_grad_once: a CSR backward walking the forward's rows in the chunks or edges order
    stages a row's grad-out block once per edge loop (``Schedule.row_grad_once``), where that window is at most
    stacked_window_bytes."""

    forward_chunk: int | None = None
    backward_chunk: int | None = None
    loop_order: str = "auto"
    backward_min_blocks: int | str = "auto"
    backward_loop_order: str | None = None
    # Measured defaults (docs/measured-constants.md); the reasons are at the rules that read them.
    single_irrep_backward_chunk: int | None = 128
    backward_chunk_passes: bool = True
    backward_range_bytes: int | None = None
    max_blocks: int | None = None
    receiver_backward_min_row_bytes: int | None = 4096
    receiver_backward_atomic: bool = False
    receiver_backward_fixed_point: bool | str = "auto"
    fixed_point_max_bytes: int = 1 << 30
    grad_y_reduce_scatter: bool = True
    row_grad_once: bool = True
    stacked_window_bytes: int = 16 * 1024

    def __post_init__(self) -> None:
        for name in ("forward_chunk", "backward_chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 32 or value % 32):
                raise ValueError(f"{name} must be None or a positive multiple of 32, got {value!r}")
        if self.loop_order not in LOOP_ORDERS:
            raise ValueError(f"loop_order must be one of {LOOP_ORDERS}, got {self.loop_order!r}")
        if self.backward_loop_order not in (None, *LOOP_ORDERS):
            raise ValueError(f"backward_loop_order must be None or one of {LOOP_ORDERS}, got "
                             f"{self.backward_loop_order!r}")
        bound = self.backward_min_blocks
        if bound != "auto" and (not isinstance(bound, int) or isinstance(bound, bool) or not 0 <= bound <= 32):
            raise ValueError(f"backward_min_blocks must be 'auto' or an int in [0, 32], got {bound!r}")
        single = self.single_irrep_backward_chunk
        if single is not None and (not _positive_int(single) or single % 32):
            raise ValueError(f"single_irrep_backward_chunk must be None or a positive multiple of 32, got {single!r}")
        for name in ("backward_chunk_passes", "receiver_backward_atomic", "grad_y_reduce_scatter", "row_grad_once"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        fixed = self.receiver_backward_fixed_point
        if not (isinstance(fixed, bool) or fixed == "auto"):
            raise ValueError(f"receiver_backward_fixed_point must be 'auto', True or False, got "
                             f"{self.receiver_backward_fixed_point!r}")
        if not _positive_int(self.stacked_window_bytes):
            raise ValueError(f"stacked_window_bytes must be a positive int, got {self.stacked_window_bytes!r}")
        if not _positive_int(self.fixed_point_max_bytes):
            raise ValueError(f"fixed_point_max_bytes must be a positive int, got {self.fixed_point_max_bytes!r}")
        for name in ("backward_range_bytes", "max_blocks", "receiver_backward_min_row_bytes"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise ValueError(f"{name} must be None or a positive int, got {value!r}")

    def order(self, backward: bool) -> str:
        """The loop order set for one direction (the backward's own where set; ``auto``: ``Schedule.loop_order``)."""
        return (self.backward_loop_order if backward else None) or self.loop_order

    def key(self) -> str:
        # fields added later enter the key only when set, so that older keys stay as they were
        bound = "" if self.backward_min_blocks == "auto" else f"|{self.backward_min_blocks}"
        order = "" if self.backward_loop_order is None else f"|b:{self.backward_loop_order}"
        later = "".join(f"|{f.name}={getattr(self, f.name)!r}" for f in fields(self)[5:]
                        if getattr(self, f.name) != f.default)
        return f"{self.forward_chunk}|{self.backward_chunk}|{self.loop_order}{bound}{order}{later}"


@dataclass(frozen=True)
class SCTuning(_Knobs):
    """Symmetric contraction kernels: block, threads per block; chunk, atoms per thread in the grad-W' kernel;
    pairings, how bilinear sums share partial results (``pd``/``qd`` raise the register count: off by default)."""

    block: int = 128
    chunk: int = 16
    pairings: tuple[str, ...] = ("pq",)

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or not 32 <= self.block <= 1024 or self.block % 32:
            raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {self.block!r}")
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {self.chunk!r}")
        if not self.pairings or any(p not in PAIRINGS for p in self.pairings):
            raise ValueError(f"pairings must be a non-empty subset of {PAIRINGS}, got {self.pairings!r}")

    def key(self) -> str:
        return f"{self.block}|{self.chunk}|{','.join(self.pairings)}"


@dataclass(frozen=True)
class RowPolicy(_Knobs):
    """When frozen per-atom maps run over their rows in chunks, which bounds their memory.

    chunked_above_bytes: rows of more bytes run in chunks of ``chunk_bytes`` (``e3nn_layers.SplitLinear`` with
    frozen weights; MACE's row chunks, ``patches.mace.row_chunks``, for the widest convolution output).
    map_into_above_bytes: frozen ``SplitLinear`` inputs of at least this many bytes (up to
    ``chunked_above_bytes``) go through ``map_into`` as one chunk of all rows (the path weights folded once, fewer
    copies). min_chunk_rows: the fewest rows of a chunk (MACE's row chunks; the edge-streaming convolution's on
    CUDA): a launch takes about one warp's latency however few rows it has, so fewer rows leave SMs idle."""

    # Measured defaults (docs/measured-constants.md).
    chunk_bytes: int = 256 << 20
    chunked_above_bytes: int = 1 << 30
    map_into_above_bytes: int = 32 << 20
    min_chunk_rows: int = 4096  # about one wave of resident warps

    def __post_init__(self) -> None:
        for name, least in (("chunk_bytes", 1), ("chunked_above_bytes", 0), ("map_into_above_bytes", 0),
                            ("min_chunk_rows", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


@dataclass(frozen=True)
class KernelTuning:
    """The tuning of every kernel of a model, what the patch functions take as ``tuning=``.

    harmonics: the edge spherical harmonics by cgforge's kernel (``kernels.harmonics``) in place of e3nn's module.
    linear_kernel_max_channels: frozen equivariant linear maps whose weight blocks have at most this many channels in
    and out run on CUDA as the ``irreps_linear`` kernel, wider ones as GEMMs (0: all GEMMs; the default measured:
    docs/measured-constants.md). rows: when frozen per-atom maps run over their rows in chunks (``RowPolicy``)."""

    tp: TPTuning = TPTuning()
    sc: SCTuning = SCTuning()
    harmonics: bool = True
    linear_kernel_max_channels: int = 32
    rows: RowPolicy = RowPolicy()

    def __post_init__(self) -> None:
        if not isinstance(self.tp, TPTuning) or not isinstance(self.sc, SCTuning):
            raise TypeError(f"KernelTuning takes a TPTuning and an SCTuning, got {type(self.tp).__name__} and "
                            f"{type(self.sc).__name__}")
        if not isinstance(self.rows, RowPolicy):
            raise TypeError(f"rows: expected a RowPolicy, got {type(self.rows).__name__}")
        if not isinstance(self.harmonics, bool):
            raise ValueError(f"harmonics: expected a bool, got {self.harmonics!r}")
        channels = self.linear_kernel_max_channels
        if not isinstance(channels, int) or isinstance(channels, bool) or channels < 0:
            raise ValueError(f"linear_kernel_max_channels: expected an int >= 0, got {channels!r}")

    def describe(self) -> str:
        """Each part, one line each (what ``cgforge doctor`` prints)."""
        return (f"TPTuning({self.tp.describe()})\nSCTuning({self.sc.describe()})\nharmonics={self.harmonics!r}\n"
                f"linear_kernel_max_channels={self.linear_kernel_max_channels!r}\nRowPolicy({self.rows.describe()})")

    @classmethod
    def from_dict(cls, data: object) -> KernelTuning:
        """The tuning a plain dict describes (what ``json.load`` returns): ``{"tp": {...}, "sc": {...}, "rows": {...},
        "harmonics": false, "linear_kernel_max_channels": 32}``, each key optional, tp, sc and rows any of their
        dataclass's fields (a list taken as a tuple). Each value is checked as the dataclass checks it; ValueError
        naming the key otherwise."""
        if not isinstance(data, dict):
            raise ValueError(f"expected an object with the keys 'tp', 'sc', 'rows', 'harmonics' and/or "
                             f"'linear_kernel_max_channels', got {type(data).__name__}")
        parts = {"tp": TPTuning, "sc": SCTuning, "rows": RowPolicy}
        unknown = sorted(map(str, set(data) - set(parts) - {"harmonics", "linear_kernel_max_channels"}))
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; a kernel tuning has the keys 'tp' (TPTuning), 'sc' "
                             "(SCTuning), 'rows' (RowPolicy), 'harmonics' (a bool) and 'linear_kernel_max_channels' "
                             "(an int >= 0)")
        values = {k: data[k] for k in ("harmonics", "linear_kernel_max_channels") if k in data}  # checked by cls
        for name, part in parts.items():
            given = data.get(name, {})
            if not isinstance(given, dict):
                raise ValueError(f"{name}: expected an object of {part.__name__}'s fields, got "
                                 f"{type(given).__name__}")
            known = [f.name for f in fields(part)]
            unknown = sorted(map(str, set(given) - set(known)))
            if unknown:
                raise ValueError(f"{name}.{unknown[0]}: unknown key; {part.__name__} has {', '.join(known)}")
            for key, value in given.items():
                if isinstance(value, bool) and key not in _BOOL_FIELDS:  # True is an int to isinstance
                    expected = next(f.type for f in fields(part) if f.name == key)
                    raise ValueError(f"{name}.{key}: expected {expected}, got {value!r}")
            try:
                values[name] = part(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
            except (TypeError, ValueError) as err:
                key = next((k for k in known if str(err).startswith(k + " ")), None)
                where = f"{name}.{key}" if key is not None else name
                raise ValueError(f"{where}: {err}") from None
        return cls(**values)


_BOOL_FIELDS = frozenset(f.name for cls in (TPTuning, SCTuning) for f in fields(cls)
                         if f.type in ("bool", bool) or "bool |" in str(f.type))
