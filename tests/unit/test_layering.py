"""The floors of the tree: every package of ``megainfer`` (and ``launch/``, ``kernels/``)
imports only packages on lower floors, anywhere in its files (a function-level import too), so
the package graph has no cycle (docs/architecture.md, "Module map")."""
import ast
import os

from repo_paths import REPO

# floor of each top-level part, lowest first; a part imports only parts on lower floors
FLOORS = {
    "kernels": 0, "conf": 0,
    "config": 1,
    "comm": 2, "models": 2, "perfmodel": 2, "eplb": 2,
    "engine": 3, "bench": 3,
    "runtime": 4,
    "engine_core": 5,  # the core's side of the one route
    "core_client": 6,  # the clients
    "llm": 7,
    "async_llm": 8,
    "serve": 9, "calibration": 9, "tools": 9,
    "launch": 10,
    "__init__": 11,
}


def _part(path: str) -> str:
    rel = os.path.relpath(path, REPO).split(os.sep)
    if rel[0] in ("launch", "kernels"):
        return rel[0]
    name = rel[1]
    return name[:-3] if name.endswith(".py") else name


def _imports(path: str):
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name


def _files():
    for top in ("megainfer", "launch", "kernels"):
        for d, _, names in os.walk(os.path.join(REPO, top)):
            for n in names:
                if n.endswith(".py"):
                    yield os.path.join(d, n)


def test_every_part_has_a_floor():
    parts = {_part(p) for p in _files()}
    assert parts <= FLOORS.keys(), sorted(parts - FLOORS.keys())


def test_no_part_imports_a_higher_or_equal_floor():
    bad = []
    for path in _files():
        src = _part(path)
        for line, mod in _imports(path):
            parts = mod.split(".")
            if parts[0] != "megainfer" or len(parts) < 2 or parts[1] == src:
                continue
            dst = parts[1]
            if dst in FLOORS and FLOORS[dst] >= FLOORS[src]:
                bad.append(f"{os.path.relpath(path, REPO)}:{line}: {src} (floor {FLOORS[src]}) "
                           f"imports {mod} (floor {FLOORS[dst]})")
    assert not bad, "\n".join(bad)
