"""The JSON registry of user models: round trips, atomic writes, and clear errors."""

import json

import pytest

from llm_paged_mlx.user_models import UserModels, check_name, check_source


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
    assert [p.name for p in tmp_path.iterdir()] == ["models.json"]
    assert json.loads((tmp_path / "models.json").read_text()) == {"models": {}}


def test_a_failed_write_keeps_the_old_file(tmp_path):
    registry = UserModels(tmp_path)
    registry.add("one", {"source": "org/repo"})
    with pytest.raises(TypeError):
        registry.add("two", {"source": "org/other", "bad": object()})  # not JSON-serializable
    assert list(registry.load()) == ["one"]
    assert [p.name for p in tmp_path.iterdir()] == ["models.json"]


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
