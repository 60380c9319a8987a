"""The package keeps no old import path but the pickle contract's (``cgforge._moved.PICKLED_CLASSES``, tested in
test_pickle_contract.py): the public names import without a warning, the first layout's module paths (never
released) are gone, and an unknown name is an AttributeError."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_public_names_import_without_a_warning() -> None:
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "from cgforge.plugin import Calculator, run_md, water_box, Engine, MDBlowUp, neighbour_list\n"
            "from cgforge.plugin.md import run_md, Engine, MDInstabilityError\n"
            "from cgforge.plugin.cli import main\n"
            "import cgforge.patches, cgforge.kernels\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("old", ["cgforge.plugin.engine", "cgforge.plugin.neighbours", "cgforge.doctor"])
def test_a_path_of_the_first_layout_is_gone(old: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=old.replace(".", r"\.")):
        importlib.import_module(old)


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    import cgforge.plugin.md as md

    with pytest.raises(AttributeError, match="no_such_name"):
        md.no_such_name  # noqa: B018
    assert not hasattr(md, "run_from_args")  # the first layout's re-export from cgforge.plugin.cli.md is gone
