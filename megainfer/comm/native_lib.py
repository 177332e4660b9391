"""Finding and loading a CUDA-side shared library (libcudart, libnccl) with ctypes: where it may
be, best first, and the first candidate that loads. Importing this needs no GPU."""
from __future__ import annotations

import ctypes
import glob
import os
from typing import Optional


def library_candidates(stem: str, env_var: str, names: list[str],
                       already_loaded: bool = False) -> list[str]:
    """Paths or sonames for ``lib<stem>``, best first: (with ``already_loaded``) the copy this
    process has mapped, ``$env_var``, the nvidia-* wheels (``nvidia/<pkg>/lib/``), torch's own
    ``lib/``, then the plain ``names`` for the dynamic loader."""
    out = []
    if already_loaded:
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    path = line.split()[-1] if line.strip() else ""
                    if f"lib{stem}" in os.path.basename(path) and path not in out:
                        out.append(path)
        except OSError:
            pass
    if os.environ.get(env_var):
        out.append(os.environ[env_var])
    try:
        import nvidia  # type: ignore  # namespace package of the CUDA wheels: a path per site dir
        for d in list(getattr(nvidia, "__path__", [])):
            out += sorted(glob.glob(os.path.join(d, "*", "lib", f"lib{stem}.so*")))
    except ImportError:
        pass
    import torch
    out += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", f"lib{stem}*.so*")))
    return out + [n for n in names if n not in out]


def load_first(candidates: list[str]) -> tuple[Optional[ctypes.CDLL], list[str]]:
    """The first candidate that loads, and the failures before it (``"path: error"``)."""
    tried = []
    for cand in candidates:
        try:
            return ctypes.CDLL(cand), tried
        except OSError as e:
            tried.append(f"{cand}: {e}")
    return None, tried
