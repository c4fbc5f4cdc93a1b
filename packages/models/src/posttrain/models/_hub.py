"""Model locations: a local directory, or a Hugging Face hub id already in the local cache.

``resolve_model_dir`` never goes online: a hub id (``org/name``) is looked up in the local
Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``) only, and one that is not there is refused
with a ``CheckpointError`` naming the download command, so a dry run answers in a second and
no training job starts a download behind the user's back.
"""

from __future__ import annotations

import re
from pathlib import Path

from posttrain.models._errors import CheckpointError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(text: str) -> bool:
    """Whether ``text`` has the ``org/name`` shape of a hub model id."""
    return bool(_HUB_ID.match(text)) and ".." not in text


def resolve_model_dir(location: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """The local directory of ``location``: the directory itself, or the cached snapshot of a
    hub id (offline). Anything else raises a ``CheckpointError`` that names it."""
    path = Path(location)
    if path.is_dir():
        return path
    text = str(location)
    if path.exists():
        raise CheckpointError(f"model path {text!r} is a file, not a checkpoint directory")
    if not is_hub_id(text):
        raise CheckpointError(
            f"model path {text!r} is neither a local directory nor a hub id (org/name)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = snapshot_download(
            text,
            local_files_only=True,
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    except (LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"model path {text!r} is not a local directory, and the hub id is not in the local "
            f"Hugging Face cache (posttrain does not download): run `hf download {text}` "
            f"(or `huggingface-cli download {text}`) first, or pass the checkpoint directory "
            f"({type(exc).__name__})"
        ) from None
    return Path(found)
