"""The one configuration path: tuning values reach the kernel modules the patch functions build, survive a
pickle, and no environment variable changes them (CPU: the plans are compared, no kernel runs)."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from e3nn import o3
from tp_cases import PROBLEMS, e3nn_tp

from cgforge.kernels import Convolution, KernelTuning, RowPolicy, SCTuning, TPTuning
from cgforge.kernels.symmetric_contraction import ops as sc_ops
from cgforge.kernels.tensor_product import plan as plans

TUNED = KernelTuning(tp=TPTuning(loop_order="edges", backward_min_blocks=0), sc=SCTuning(block=64, chunk=8),
                     rows=RowPolicy(chunked_above_bytes=0, min_chunk_rows=7))


def test_kernel_tuning_holds_both_and_prints_every_knob() -> None:
    assert KernelTuning() == KernelTuning(TPTuning(), SCTuning())
    text = TUNED.describe()
    assert "loop_order='edges'" in text and "block=64" in text and "backward_range_bytes=None" in text
    assert "min_chunk_rows=7" in text


def test_mace_patch_passes_the_tuning_to_every_kernel_module(monkeypatch) -> None:
    pytest.importorskip("mace")
    from cgforge.patches.mace import FusedConvTP, FusedSymmetricContraction, load_mace, patch
    from cgforge.plugin.runtime.bundled import model_path

    monkeypatch.setenv("CGFORGE_LOOP_ORDER", "chunks")  # a leftover variable: read by nothing
    plain = load_mace(model_path("mace"), patched=False)  # patched in the file's dtype, as load_mace does
    default = patch(load_mace(model_path("mace"), patched=False))
    tuned = patch(plain, tuning=TUNED)
    convs = [m for m in tuned.modules() if isinstance(m, FusedConvTP)]
    contractions = [m for m in tuned.modules() if isinstance(m, FusedSymmetricContraction)]
    assert len(convs) == 2 and len(contractions) == 2  # every block patched (the self-checks passed)
    for m in convs:
        assert m.conv.tuning == TUNED.tp and plans.get(m.conv.key).tuning == TUNED.tp
    for m in contractions:
        assert m.tuning == TUNED.sc and sc_ops.get(m.key).tuning == TUNED.sc
    from cgforge.patches.e3nn_layers import SplitLinear

    linears = [m for m in tuned.modules() if isinstance(m, SplitLinear)]
    assert linears and all(m.rows == TUNED.rows for m in [*convs, *linears])  # the row policy: one value
    assert all(m.rows == RowPolicy() for m in default.modules() if isinstance(m, FusedConvTP | SplitLinear))
    for m in default.modules():
        if isinstance(m, FusedConvTP):
            assert plans.get(m.conv.key).tuning == TPTuning()
        if isinstance(m, FusedSymmetricContraction):
            assert sc_ops.get(m.key).tuning == SCTuning()
    buf = io.BytesIO()
    torch.save(tuned, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    again = [m for m in loaded.modules() if isinstance(m, FusedConvTP)]
    assert [plans.get(m.conv.key).tuning for m in again] == [TUNED.tp] * len(convs)
    assert all(m.rows == TUNED.rows for m in again)


class _Original(torch.nn.Module):
    """The attributes the NequIP stand-in reads from nequip's TensorProductScatter."""

    def __init__(self, tp: torch.nn.Module) -> None:
        super().__init__()
        self.feature_irreps_in, self.irreps_edge_attr = tp.irreps_in1, tp.irreps_in2
        self.irreps_mid, self.instructions, self.model_dtype = tp.irreps_out, tp.instructions, torch.float64
        self.tp = tp


def test_nequip_stand_in_keeps_its_tuning_through_a_pickle() -> None:
    pytest.importorskip("nequip")
    from cgforge.patches.graph_cache import CallGraphCache
    from cgforge.patches.nequip.conv import CgforgeTensorProductScatter

    tp = e3nn_tp(PROBLEMS["nequip-water"])
    stand_in = CgforgeTensorProductScatter(_Original(tp), CallGraphCache(), TUNED.tp)
    assert isinstance(stand_in.conv, Convolution) and stand_in.conv.tuning == TUNED.tp
    copy = pickle.loads(pickle.dumps(stand_in))
    assert copy.conv.tuning == TUNED.tp and plans.get(copy.conv.key).tuning == TUNED.tp
    assert CgforgeTensorProductScatter(_Original(tp), CallGraphCache()).conv.key != stand_in.conv.key


def test_a_convolution_pickled_before_the_later_knobs_reads_their_defaults() -> None:
    conv = Convolution.from_e3nn(e3nn_tp(PROBLEMS["nequip-water"]), tuning=TPTuning(loop_order="segments"))
    state = conv.tuning.__dict__
    old = object.__new__(TPTuning)
    object.__setattr__(old, "__dict__", {k: state[k] for k in list(state)[:5]})  # the five fields of before
    assert old == TPTuning(loop_order="segments") and old.max_blocks is None and old.backward_chunk_passes


def test_sc_module_takes_the_tuning() -> None:
    pytest.importorskip("mace")
    from cgforge.patches.mace import SymmetricContraction

    irreps = o3.Irreps("4x0e+4x1o")
    module = SymmetricContraction(irreps, o3.Irreps("4x0e"), 2, 2, tuning=TUNED.sc)
    assert sc_ops.get(module.key).tuning == TUNED.sc
    assert sc_ops.get(SymmetricContraction(irreps, o3.Irreps("4x0e"), 2, 2).key).tuning == SCTuning()
