"""What a source file imports, read from its syntax tree (the layering tests: no lower layer
imports a higher one)."""
import ast
import os


def imports_of(path: str):
    """The absolute modules ``path`` imports (relative imports are the package's own: skipped)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def py_files(folder: str) -> list[str]:
    """Every ``.py`` file under ``folder``."""
    return sorted(os.path.join(root, f) for root, _, files in os.walk(folder)
                  for f in files if f.endswith(".py"))
