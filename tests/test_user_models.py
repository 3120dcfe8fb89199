"""The JSON registry of user models: round trips, atomic and locked writes, and clear errors."""

import json
import os
import re
import subprocess
import sys

import pytest

from llm_paged_mlx.user_models import UserModels, check_name, check_source, imported_folder


def test_add_load_remove_round_trip(tmp_path):
    registry = UserModels(tmp_path / "paged")
    assert registry.load() == {}
    registry.add("one", {"source": "org/repo"})
    registry.add("two", {"source": "/models/two", "gguf": "/files/two.gguf"})
    assert UserModels(tmp_path / "paged").load() == {
        "one": {"source": "org/repo"},
        "two": {"source": "/models/two", "gguf": "/files/two.gguf"},
    }
    assert registry.remove("one") == {"source": "org/repo"}
    assert list(registry.load()) == ["two"]
    with pytest.raises(KeyError):
        registry.remove("one")


def test_writes_leave_no_temporary_files(tmp_path):
    registry = UserModels(tmp_path)
    registry.add("one", {"source": "org/repo"})
    registry.remove("one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models.json", "models.json.lock"]
    assert json.loads((tmp_path / "models.json").read_text()) == {"models": {}}


def test_a_failed_write_keeps_the_old_file(tmp_path):
    registry = UserModels(tmp_path)
    registry.add("one", {"source": "org/repo"})
    with pytest.raises(TypeError):
        registry.add("two", {"source": "org/other", "bad": object()})  # not JSON-serializable
    assert list(registry.load()) == ["one"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models.json", "models.json.lock"]


def test_duplicate_names_are_refused(tmp_path):
    registry = UserModels(tmp_path)
    registry.add("one", {"source": "org/repo"})
    with pytest.raises(ValueError, match="already registered"):
        registry.add("one", {"source": "org/other"})


@pytest.mark.parametrize("content", ["{not json", "[]", '{"models": {"x": 1}}', '{"models": {"x": {}}}'])
def test_a_broken_registry_is_a_clear_error(tmp_path, content):
    (tmp_path / "models.json").write_text(content)
    with pytest.raises(ValueError, match="models.json"):
        UserModels(tmp_path).load()


@pytest.mark.parametrize("name", ["", "-x", "has space", "a/b", "../up", "tab\t"])
def test_unusable_names(name):
    with pytest.raises(ValueError, match="not a usable model name"):
        check_name(name)


def test_usable_names():
    for name in ["smol", "Qwen3-0.6B", "my_model.v2"]:
        check_name(name)


def test_sources(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        check_source(str(folder))
    (folder / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        check_source(str(folder))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    assert check_source(str(folder)) == str(folder.resolve())
    assert check_source("mlx-community/Qwen3-0.6B-4bit") == "mlx-community/Qwen3-0.6B-4bit"
    for bad in ["no-such-folder", "a/b/c", "org/..", str(tmp_path / "missing")]:
        with pytest.raises(ValueError, match="neither an existing folder nor"):
            check_source(bad)



def test_imported_folder_is_only_the_folder_import_gguf_made_for_that_name(tmp_path):
    imported = tmp_path / "imported"
    for name in ["a", "b"]:
        (imported / name).mkdir(parents=True)
    assert imported_folder(imported, "a", str(imported / "a")) == (imported / "a").resolve()
    (tmp_path / "link").symlink_to(tmp_path, target_is_directory=True)
    assert imported_folder(imported, "a", str(tmp_path / "link" / "imported" / "a")) == (imported / "a").resolve()
    (imported / "c").symlink_to(imported / "b", target_is_directory=True)
    (imported / "loop").symlink_to(imported / "loop")
    for name, source in [("a", imported / "a" / ".." / "b"), ("a", imported), ("a", imported / "b"),
                         ("c", imported / "c"), ("loop", imported / "loop"), ("gone", imported / "gone")]:
        with pytest.raises(ValueError):
            imported_folder(imported, name, str(source))


@pytest.mark.parametrize("target_exists", [False, True], ids=["to nothing", "to a file"])
def test_a_symlink_at_the_lock_is_a_clear_error_and_never_followed(target_exists, tmp_path, monkeypatch):
    """The lock was opened with O_CREAT and without O_NOFOLLOW: a link there made add create its target."""
    from click.testing import CliRunner
    from llm.cli import cli

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    registry, target = UserModels(tmp_path / "paged-mlx"), tmp_path / "outside"
    registry.add("one", {"source": "org/repo"})
    if target_exists:
        target.write_text("mine")
        os.utime(target, ns=(0, 0))
    registry.lock_path.unlink()
    registry.lock_path.symlink_to(target)
    message = f"cannot lock the model registry: {registry.lock_path} is a symbolic link, not a lock file; remove it"
    for change in (lambda: registry.add("two", {"source": "org/other"}), lambda: registry.remove("one")):
        with pytest.raises(ValueError, match=re.escape(message)):
            change()
    result = CliRunner().invoke(cli, ["paged-mlx", "add", "org/other", "--alias", "two"])
    assert result.exit_code == 1 and result.output == f"Error: {message}\n"
    assert list(registry.load()) == ["one"]
    assert target.exists() == target_exists and registry.lock_path.is_symlink()
    if target_exists:
        assert target.read_text() == "mine" and target.stat().st_mtime_ns == 0


CONCURRENT_ADDS = """
import sys
from llm_paged_mlx.user_models import UserModels
directory, process = sys.argv[1], sys.argv[2]
for index in range(20):
    UserModels(directory).add(f"p{process}-{index}", {"source": "org/repo"})
"""


def test_concurrent_adds_from_several_processes_all_land(tmp_path):
    """Each add reads, changes and rewrites the file: without a lock, one process's write drops another's."""
    processes = [subprocess.Popen([sys.executable, "-c", CONCURRENT_ADDS, str(tmp_path), str(p)]) for p in range(6)]
    assert [process.wait(timeout=120) for process in processes] == [0] * 6
    assert sorted(UserModels(tmp_path).load()) == sorted(f"p{p}-{i}" for p in range(6) for i in range(20))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left
