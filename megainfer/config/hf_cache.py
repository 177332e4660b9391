"""``model.path`` as a vLLM user types it -> a local checkpoint directory: a directory as it is,
or a Hugging Face model id (``org/name``) found in the local Hugging Face cache through
``huggingface_hub`` (``models--org--name/refs/<revision>`` -> ``snapshots/<commit>/``). Nothing
is downloaded at run time: a model that is not in the cache is an error saying how to fetch it.

The cache is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub`` (read
when called, so a changed environment is honoured)."""
from __future__ import annotations

import os
import re
from typing import Optional

from .base import ConfigError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the Hub spells ids


def hub_cache_dir() -> str:
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return os.path.expanduser(env["HF_HUB_CACHE"])
    return os.path.join(os.path.expanduser(env.get("HF_HOME") or "~/.cache/huggingface"), "hub")


def checkpoint_dir(path: str, revision: Optional[str] = None) -> str:
    """A directory path (``~`` expanded) or a cached model id -> the directory to read."""
    local = os.path.expanduser(str(path))
    if os.path.isdir(local):
        if revision is not None:
            raise ConfigError(f"model.revision={revision!r}: a revision selects a snapshot of a "
                              f"Hugging Face model id, and model.path={path!r} is a local "
                              "directory (drop the revision)")
        return local
    if not REPO_ID.match(str(path)):
        raise ConfigError(f"model.path={path!r}: no such directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    cache = hub_cache_dir()
    try:
        return snapshot_download(str(path), revision=revision, cache_dir=cache,
                                 local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        rev = f" at revision {revision!r}" if revision else ""
        fetch = f"hf download {path}" + (f" --revision {revision}" if revision else "")
        raise ConfigError(f"model.path={path!r}: no such directory, and {path}{rev} is not in "
                          f"the local Hugging Face cache ({cache}); fetch it first with "
                          f"`{fetch}` (megainfer downloads nothing at run time)") from None
