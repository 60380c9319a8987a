"""The model's energy compiled by ``torch.compile`` (Inductor) for the potential's step (``compile=...``).

The adapter's ``energy`` is one graph (``fullgraph=True``, backward through AOTAutograd; cgforge's kernels are
opaque custom ops) inside ``ModelStep``'s own CUDA graph (hence ``MODES``), its edge dimension dynamic. A
configuration that cannot work is refused early (``check_compile``); a failed compilation warns and runs eagerly
(``CompiledEnergy.error``). docs/calculator.md has the rest.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

# Inductor modes that leave CUDA graphs to the step (the others capture their own, which cannot nest in it).
MODES = ("default", "max-autotune-no-cudagraphs")
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")

# What a failed compilation raises: dynamo's errors (Inductor's and the backends' among them) and, under
# fullgraph=True, the recompile limit (torch._dynamo.config.recompile_limit; calculators share dynamo's cache).
_COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException,
                   getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", torch._dynamo.exc.TorchDynamoException))

# Inductor's hint on a TF32-capable GPU, not shown: cgforge keeps FP32 products unless a radial-precision mode
# (with its force check) is picked, and the hint would invite TF32 for every matmul.
_TF32_HINT = "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled"

EnergyFn = Callable[[Tensor, Tensor, Tensor, Tensor, bool], tuple[Tensor, Tensor | None]]


def parse_compile(value: object, name: str = "compile", others: tuple[str, ...] = ()) -> str | None:
    """None (no compilation) for False/None, the Inductor mode for True ("default") or a mode name. ``others``:
    words the caller accepts besides (named in the error)."""
    if value is None or isinstance(value, bool):
        return "default" if value else None
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected True, False or an Inductor mode ({', '.join(MODES)}), got "
                        f"{type(value).__name__} {value!r}")
    if value in _CUDAGRAPH_MODES:
        raise ValueError(f"{name}: mode {value!r} captures CUDA graphs of its own, which cannot nest in the step's "
                         f"capture; use one of {', '.join(MODES)} (the step is captured anyway)")
    if value not in MODES:
        flags = "" if name.startswith("--") else "True, False or "
        raise ValueError(f"{name}: expected {flags}one of {', '.join((*others, *MODES))}, got {value!r}")
    return value


def check_compile(device: torch.device, *, patched: bool, streaming: bool, backend: str | Callable = "inductor"
                  ) -> None:
    """Raise (naming the problem) when ``compile`` cannot work on ``device`` for a model ``patched`` by cgforge or
    not, ``streaming`` or not, with the ``torch.compile`` ``backend``: checked when a potential is made."""
    if not patched:
        raise ValueError("compile: needs a model patched by cgforge (patch=True): the compiled graph keeps "
                         "cgforge's kernels as custom ops and serves them the step's pinned edge graph; the "
                         "unpatched e3nn code is not supported")
    if streaming:
        raise ValueError("compile and streaming=True: the streaming convolution reads its chunk ranges on the host, "
                         "which torch.compile cannot put in one graph")
    if not torch._dynamo.is_dynamo_supported():
        raise RuntimeError(f"compile: torch.compile is not supported with this Python/torch "
                           f"({torch.__version__}); use compile=False")
    if backend != "inductor":  # e.g. aot_eager (tests): no code generation, no compiler needed
        return
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise RuntimeError("compile: Inductor needs Triton for CUDA devices and it is not importable (pip "
                               "install triton, the version matching torch); use compile=False")
    elif device.type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()  # searches torch._inductor.config.cpp.cxx (and $CXX)
        except Exception as err:  # noqa: BLE001 - torch raises its own error types for "none found"
            raise RuntimeError(f"compile: Inductor's CPU backend needs a C++ compiler and found none ({err}); "
                               "install one (g++) or use compile=False") from err
    else:
        raise ValueError(f"compile: supported on cuda and cpu devices, got {device}")


class CompiledEnergy:
    """``energy`` (an adapter's) compiled once with ``torch.compile(mode=mode, fullgraph=True)`` by ``backend``;
    eager from the first compilation failure on (with a warning; ``error`` says why)."""

    def __init__(self, energy: EnergyFn, mode: str, backend: str | Callable = "inductor") -> None:
        self.eager = energy
        self.error: str | None = None
        inductor = backend == "inductor"
        self._compiled: EnergyFn | None = torch.compile(energy, backend=backend, mode=mode if inductor else None,
                                                        fullgraph=True)

    def __call__(self, positions: Tensor, vectors: Tensor, species: Tensor, edge_index: Tensor, per_atom: bool,
                 edges_dynamic: tuple[Tensor, ...] | None = None) -> tuple[Tensor, Tensor | None]:
        """The energy; ``edges_dynamic``: tensors whose first dimension (the edges) varies from call to call,
        besides ``vectors`` and ``edge_index`` (marked dynamic, so a new edge count does not recompile)."""
        if self._compiled is None:
            return self.eager(positions, vectors, species, edge_index, per_atom)
        if edges_dynamic is not None:
            torch._dynamo.maybe_mark_dynamic(vectors, 0)
            torch._dynamo.maybe_mark_dynamic(edge_index, 1)
            for t in edges_dynamic:
                if t.numel():
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_TF32_HINT)
                return self._compiled(positions, vectors, species, edge_index, per_atom)
        except _COMPILE_ERRORS as err:
            self._compiled = None
            self.error = _reason(err)
            warnings.warn(f"cgforge: torch.compile of the model failed, running it eagerly ({self.error})",
                          RuntimeWarning, stacklevel=3)
            return self.eager(positions, vectors, species, edge_index, per_atom)


def compile_or_eager(fn: Callable, backend: str | Callable = "inductor") -> Callable:
    """``fn`` (a pure tensor function: the engine's integrator arithmetic) compiled with ``torch.compile`` by
    ``backend`` (one graph, static shapes); eager from its first failed compilation on, with a warning."""
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    state = {"failed": False}

    def call(*args):
        if state["failed"]:
            return fn(*args)
        try:
            return compiled(*args)
        except _COMPILE_ERRORS as err:
            state["failed"] = True
            warnings.warn(f"cgforge: torch.compile of {fn.__name__} failed, running it eagerly ({_reason(err)})",
                          RuntimeWarning, stacklevel=2)
            return fn(*args)

    call.__name__ = fn.__name__
    return call


def _reason(err: BaseException) -> str:
    """One line: the dynamo error's first line and, when it wraps one (a backend's), the error inside."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0] if lines else ''}"
    inner = getattr(err, "inner_exception", None) or err.__cause__
    if inner is not None and inner is not err:
        inner_lines = str(inner).strip().splitlines()
        text += f" {type(inner).__name__}: {inner_lines[0] if inner_lines else ''}"
    return text[:500]
