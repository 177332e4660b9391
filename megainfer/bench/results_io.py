"""Writing a perf script's JSON result: one helper so every script does it the same way.

``write_json`` writes to a temporary file beside the target and renames it over the target,
so a run that dies while writing leaves the previous result whole instead of half a file.
"""
from __future__ import annotations

import json
import os


def write_json(path: str, obj, indent: int = 1, quiet: bool = False) -> str:
    """Write ``obj`` as JSON to ``path`` (parent folders made); returns ``path``."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if not quiet:
        print(f"wrote {path}")
    return path
