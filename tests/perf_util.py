"""Import a script of perf/ as a module (perf/ is a folder of scripts, not a package)."""
import importlib
import os
import sys

PERF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "perf")


def import_perf(name: str):
    sys.path.insert(0, PERF)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(PERF)
