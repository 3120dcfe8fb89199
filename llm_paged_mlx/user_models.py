"""The user's own models: a small JSON registry of names and where their weights are.

An entry is ``{"source": folder or Hugging Face repo id}``, plus ``"gguf"`` (the file it
was converted from) for folders made by ``import-gguf``. Changes hold an exclusive lock on
``models.json.lock``, so concurrent ``llm`` processes do not lose each other's entries, and
rewrite the file whole through a synced temporary file and ``os.replace``, so it is never
seen half-written, even after a crash.
"""

import contextlib
import json
import re
from pathlib import Path

from . import files

REGISTRY_FILE = "models.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class UserModels:
    """The registry kept in ``directory/models.json``."""

    def __init__(self, directory):
        self.path = Path(directory) / REGISTRY_FILE
        self.lock_path = self.path.with_name(REGISTRY_FILE + ".lock")

    def load(self) -> dict[str, dict]:
        """Name -> entry. Raises ValueError if the file is not a registry."""
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the model registry {self.path}: {e}") from None
        models = data.get("models") if isinstance(data, dict) else None
        if not isinstance(models, dict) or not all(
            isinstance(entry, dict) and isinstance(entry.get("source"), str) for entry in models.values()
        ):
            raise ValueError(f"{self.path} is not a model registry")
        return models

    def add(self, name: str, entry: dict) -> None:
        """Register ``name``; raises ValueError if it is taken or not a usable name."""
        check_name(name)
        with self._locked():
            models = self.load()
            if name in models:
                raise ValueError(f"a model named {name!r} is already registered (remove it first)")
            models[name] = entry
            self._save(models)

    def remove(self, name: str) -> dict:
        """Unregister ``name`` and return its entry; raises KeyError if unknown."""
        with self._locked():
            models = self.load()
            if name not in models:
                raise KeyError(name)
            entry = models.pop(name)
            self._save(models)
        return entry

    @contextlib.contextmanager
    def _locked(self):
        """Hold the registry's lock (between processes) for a read-modify-write; ValueError if it cannot be had."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(files.locked(self.lock_path))
            except OSError as e:  # a symlink there, a read-only folder...
                raise ValueError(f"cannot lock the model registry: {e}") from None
            yield

    def _save(self, models: dict) -> None:
        payload = json.dumps({"models": models}, indent=2) + "\n"
        files.write_atomically(self.path, payload.encode(), durable=True)


def check_name(name: str) -> None:
    """Raise ValueError unless ``name`` can be a model id typed on the command line."""
    if not _NAME.match(name):
        raise ValueError(
            f"{name!r} is not a usable model name: use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )


def check_source(path_or_repo: str) -> str:
    """An existing model folder (made absolute) or a Hugging Face repo id, else ValueError."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        config = path / "config.json"
        if not config.is_file():
            raise ValueError(f"{path} has no config.json, so it is not an mlx-lm model folder")
        try:
            json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{config} is not valid JSON: {e}") from None
        return str(path.resolve())
    if _REPO_ID.match(path_or_repo) and ".." not in path_or_repo:
        return path_or_repo
    raise ValueError(f"{path_or_repo} is neither an existing folder nor a Hugging Face repo id (owner/name)")


def imported_folder(imported_dir, name: str, source: str) -> Path:
    """The folder ``import-gguf`` made for ``name`` in ``imported_dir``, if ``source`` is it; else ValueError why not.

    Paths are compared resolved, so a source spelled through a symlinked user dir is still
    the folder, and one spelled ``imported/a/../b`` or through a symlink in the imported dir
    is not: it is a sibling's folder.
    """
    try:
        folder = Path(imported_dir).resolve() / name
        resolved = Path(source).resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise ValueError(f"it cannot be resolved ({e})") from None
    if resolved != folder:
        raise ValueError(f"it is not {folder}, the folder import-gguf made for {name}")
    if folder.is_symlink() or not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    return folder
