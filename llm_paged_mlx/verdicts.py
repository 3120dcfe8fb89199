"""Verdicts kept across processes: a JSON file of fingerprint -> None (passed) or the reason for refusing.

The model check at load and the fused kernels' first-use self-checks keep theirs in one file (the plugin's
``paged-mlx/verdicts.json``), each under fingerprints of what decides the verdict, the code that computes it
among them.
"""

import hashlib
import json
import warnings
from pathlib import Path
from typing import Iterable, Optional

from . import files


def read(path) -> dict:
    """The verdicts kept in ``path``; none if it is missing or unreadable."""
    try:
        stored = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(stored, dict):
        return {}
    return {key: verdict for key, verdict in stored.items() if verdict is None or isinstance(verdict, str)}


def keep(path, key: str, verdict: Optional[str], what: str) -> None:
    """Add ``key``'s ``verdict`` to the file (rewritten whole, or not at all); a file that cannot be written is
    warned about, naming ``what`` gave the verdict. Two processes that keep verdicts at once may lose one of
    them: it is measured again."""
    stored = read(path)
    if key in stored and stored[key] == verdict:
        return
    try:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_atomically(path, json.dumps({**stored, key: verdict}, indent=1, sort_keys=True).encode())
    except OSError as e:
        warnings.warn(f"could not keep {what}'s verdict in {path} ({e})", RuntimeWarning, stacklevel=2)


def code_hash(paths: Iterable[Path]) -> str:
    """A hash of the regular files at ``paths`` (names and contents, in the order given): an editor's lock link
    beside a source is not code."""
    digest = hashlib.sha256()
    for path in paths:
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()
