"""Old import paths of modules that moved when the plugin was split by job still work, with a warning that names
the new place (``cgforge._moved``); new paths import without any warning."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from cgforge._moved import MOVED_MODULES, MOVED_NAMES


@pytest.mark.parametrize("old, new", sorted(MOVED_MODULES.items()))
def test_old_module_path_is_the_new_module_with_a_warning(old: str, new: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


@pytest.mark.parametrize("package, name", sorted(MOVED_NAMES))
def test_old_name_of_a_package_is_the_new_one_with_a_warning(package: str, name: str) -> None:
    new = MOVED_NAMES[(package, name)]
    with pytest.warns(DeprecationWarning, match=f"{new}.{name}".replace(".", r"\.")):
        value = getattr(importlib.import_module(package), name)
    assert value is getattr(importlib.import_module(new), name)


@pytest.mark.slow
def test_public_names_import_without_a_warning() -> None:
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "from cgforge.plugin import Calculator, run_md, water_box, Engine, MDBlowUp, neighbour_list\n"
            "from cgforge.plugin.md import run_md, Engine, MDInstabilityError\n"
            "from cgforge.cli import main\n"
            "import cgforge.patches, cgforge.kernels\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    import cgforge.plugin.md as md

    with pytest.raises(AttributeError, match="no_such_name"):
        md.no_such_name  # noqa: B018
