"""Which model a folder holds, told by its content: the disk tier files K/V blocks under it.

A model id is the folder's path, a digest of its config.json and of each weight file
(``*.safetensors``), and the load settings that shape the K/V. Hashing a weight file
reads all of it, so each file's digest is kept in a small JSON file, keyed by the
file's path and (size, mtime, inode, ctime): a file replaced, or rewritten in place
with its old mtime put back, is hashed again, since a write always moves its ctime.
"""

import contextlib
import hashlib
import json
from pathlib import Path

from .. import files

CHUNK = 1 << 20  # weight files are read this much at a time, never whole


def model_identity(model_path, digest_cache, **settings) -> str:
    """A model id for the disk cache: the folder, the content of its config and weight files, and load settings.

    ``digest_cache`` is the JSON file that keeps the weight files' digests.
    ``settings`` are what else shapes the K/V, e.g. ``dtype="float32"``.
    """
    path = Path(model_path).resolve()
    known = _read_cache(Path(digest_cache))
    digest = hashlib.blake2b((path / "config.json").read_bytes(), digest_size=16)
    changed = False
    for weights in sorted(path.glob("*.safetensors")):
        stat = weights.stat()  # taken before hashing: a write meanwhile moves ctime, so the next call hashes again
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns]
        entry = known.get(str(weights))
        if not (isinstance(entry, dict) and entry.get("stat") == stamp and isinstance(entry.get("blake2b"), str)):
            entry = known[str(weights)] = {"stat": stamp, "blake2b": file_digest(weights)}
            changed = True
        digest.update(f"{weights.name}:{entry['blake2b']};".encode())
    if changed:
        _write_cache(Path(digest_cache), known)
    extra = ",".join(f"{k}={v}" for k, v in sorted(settings.items()))
    return f"{path}#{digest.hexdigest()}" + (f"#{extra}" if extra else "")


def file_digest(path) -> str:
    """The blake2b digest of a file's content, read ``CHUNK`` bytes at a time."""
    digest = hashlib.blake2b()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as file:
        while count := file.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def _read_cache(cache: Path) -> dict:
    try:
        known = json.loads(cache.read_bytes())
    except (OSError, ValueError, RecursionError):  # missing or damaged: the digests are computed again
        return {}
    return known if isinstance(known, dict) else {}


def _write_cache(cache: Path, known: dict) -> None:
    """Replace the cache file whole; if that fails, the next call only hashes again."""
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        files.write_atomically(cache, json.dumps(known).encode())
