"""``megainfer.config`` is the ground floor: it imports no megainfer package above it (only
``megainfer.kernels``' limits, and the kernels import nothing of megainfer), so every layer can
read the config and the config never reads a layer (docs/architecture.md, "Module map")."""
import os

import pytest
from layout_util import imports_of, py_files
from repo_paths import REPO

CONFIG = py_files(os.path.join(REPO, "megainfer", "config"))
KERNELS = py_files(os.path.join(REPO, "kernels"))


@pytest.mark.parametrize("path", CONFIG, ids=os.path.basename)
def test_config_imports_nothing_above_it(path):
    bad = [m for m in imports_of(path) if m.split(".")[0] == "megainfer"
           and not m.startswith(("megainfer.config", "megainfer.kernels", "megainfer.conf"))]
    assert not bad, f"{os.path.relpath(path, REPO)} imports {bad}"


@pytest.mark.parametrize("path", KERNELS, ids=os.path.basename)
def test_the_kernels_import_nothing_of_megainfer(path):
    bad = [m for m in imports_of(path) if m.split(".")[0] == "megainfer"]
    assert not bad, f"{os.path.relpath(path, REPO)} imports {bad}"


def test_the_library_imports_no_launcher():
    """``megainfer/`` never reaches into ``launch/`` (the front door sits above the library)."""
    for path in py_files(os.path.join(REPO, "megainfer")):
        bad = [m for m in imports_of(path) if m.startswith("megainfer.launch")]
        assert not bad, f"{os.path.relpath(path, REPO)} imports {bad}"
