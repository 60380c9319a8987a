"""The adapter's lean MACE forward (cgforge.patches.mace.lean_forward): per-atom energies and their gradient with
respect to the edge vectors equal, bit for bit, to MACE's own forward on the same inputs (FP64, CPU), for a
ScaleShiftMACE, a MACE, a first block of another class, with cgforge's patches and without; models it does not
handle are named and keep MACE's forward."""

from __future__ import annotations

import copy

import pytest
import torch
from mace_helpers import batch_for, build_model, water_dimer

from cgforge.patches import mace as pm
from cgforge.patches.mace import lean_forward
from cgforge.patches.mace.adapter import MaceAdapter

MODELS = {
    "scale-shift": {},
    "mace": {"scale_shift": False},
    "first-block": {"first": "RealAgnosticInteractionBlock"},
}


def _energies_and_grad(adapter: MaceAdapter, lean: bool, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    adapter.lean = lean
    vectors = inputs["vectors"].clone().requires_grad_()
    total, node_energy = adapter.energy(inputs["positions"], vectors, inputs["species"], inputs["edge_index"], True)
    (grad,) = torch.autograd.grad(total, vectors)
    return node_energy.detach(), grad


@pytest.mark.parametrize("patched", [False, True], ids=["mace", "patched"])
@pytest.mark.parametrize("name", list(MODELS))
def test_lean_forward_equals_mace_forward_bit_for_bit(name: str, patched: bool) -> None:
    model = build_model(**MODELS[name])
    if patched:
        model = pm.patch(copy.deepcopy(model))
    batch = batch_for(model, water_dimer(0.1))
    sender, receiver = batch["edge_index"]
    inputs = {"positions": batch["positions"], "species": batch["node_attrs"], "edge_index": batch["edge_index"],
              "vectors": batch["positions"][receiver] - batch["positions"][sender] + batch["shifts"]}
    adapter = MaceAdapter(model, torch.device("cpu"))
    assert adapter.lean and lean_forward.why_not_lean(model) is None
    lean = _energies_and_grad(adapter, True, inputs)
    full = _energies_and_grad(adapter, False, inputs)
    assert lean[0].dtype == full[0].dtype and lean[0].abs().sum() > 0 and lean[1].abs().sum() > 0
    assert torch.equal(lean[0], full[0]) and torch.equal(lean[1], full[1])


def test_models_it_does_not_handle_are_named_and_keep_mace_forward(monkeypatch) -> None:
    model = build_model()
    monkeypatch.setattr(lean_forward, "mace_version", lambda: "0.3.10")
    assert lean_forward.why_not_lean(model) == ("mace-torch 0.3.10 is not a version whose forward cgforge has read "
                                                "(0.3.16)")
    monkeypatch.undo()
    model.joint_embedding = torch.nn.Identity()
    assert lean_forward.why_not_lean(model) == "the model has a joint_embedding"
    assert not MaceAdapter(model, torch.device("cpu")).lean

    class Other(torch.nn.Module):
        pass

    assert "Other is not one of mace's MACE, ScaleShiftMACE" in lean_forward.why_not_lean(Other())
