"""The ``llm paged-mlx`` commands: register, list, import and remove the plugin's models."""

import shutil
from pathlib import Path

import click
import llm

from .plugin import BUILTIN_MODELS, fetch_smollm2, one_line, plugin_dir, user_models
from .user_models import check_name, check_source


@click.group(name="paged-mlx")
def paged_mlx():
    "Models served by llm-paged-mlx (paged KV cache on MLX)"


@paged_mlx.command()
@click.argument("path_or_repo")
@click.option("--alias", "name", help="Model id for llm -m (default: the folder or repo name)")
def add(path_or_repo, name):
    "Register an mlx-lm model folder or a Hugging Face repo (downloaded on first use)"
    try:
        source = check_source(path_or_repo)
        name = name or Path(source).name
        _check_unused(name)
        user_models().add(name, {"source": source})
    except ValueError as e:
        raise click.ClickException(str(e))
    click.echo(f"Added {name}: {source}")


@paged_mlx.command(name="list")
def list_models():
    "List the models llm-paged-mlx serves"
    for name, (source, _) in BUILTIN_MODELS.items():
        click.echo(f"{name}: {source} (built in)")
    try:
        registered = user_models().load()
    except ValueError as e:
        raise click.ClickException(str(e))
    for name, entry in registered.items():
        origin = f" (converted from {entry['gguf']})" if "gguf" in entry else ""
        click.echo(f"{name}: {entry['source']}{origin}")


@paged_mlx.command()
@click.argument("name")
def remove(name):
    "Unregister a model (and delete its folder if import-gguf made it)"
    if name in BUILTIN_MODELS:
        raise click.ClickException(f"{name} is built in and cannot be removed")
    try:
        entry = user_models().remove(name)
    except KeyError:
        raise click.ClickException(f"no model named {name!r} is registered (see: llm paged-mlx list)")
    except ValueError as e:  # an unreadable registry
        raise click.ClickException(str(e))
    if "gguf" in entry:
        from .user_models import imported_folder

        try:  # only the folder import-gguf made for this name: never a sibling's, nor the imported dir
            shutil.rmtree(imported_folder(_imported_dir(), name, entry["source"]), ignore_errors=True)
        except ValueError as e:
            click.echo(f"{entry['source']} not deleted: {e}")
    click.echo(f"Removed {name}")


@paged_mlx.command(name="import-gguf")
@click.argument("gguf_file", type=click.Path(path_type=Path))
@click.option("--alias", "name", help="Model id for llm -m (default: the file name without .gguf)")
def import_gguf(gguf_file, name):
    "Convert a llama-architecture GGUF file into an MLX folder and register it"
    from .models.gguf import convert_gguf

    name = name or gguf_file.name.removesuffix(".gguf")
    target = _imported_dir() / name
    try:
        if not gguf_file.is_file():
            raise ValueError(f"{gguf_file} is not a file")
        _check_unused(name)
        if target.exists():
            raise ValueError(f"{target} already exists")
        convert_gguf(gguf_file, target)
    except (ValueError, OSError) as e:
        raise click.ClickException(one_line(e))
    try:
        user_models().add(name, {"source": str(target), "gguf": str(gguf_file.resolve())})
    except BaseException as e:  # leave no unregistered folder behind
        shutil.rmtree(target, ignore_errors=True)
        if isinstance(e, ValueError):  # an unreadable registry
            raise click.ClickException(str(e)) from None
        raise
    click.echo(f"Imported {name} into {target}")


@paged_mlx.command(name="fetch-default")
def fetch_default():
    "Download and convert the default model (paged-smollm2) now; prints its folder"
    try:
        click.echo(fetch_smollm2())
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(one_line(e))


def _imported_dir() -> Path:
    return plugin_dir() / "imported"


def _check_unused(name: str) -> None:
    """ValueError if ``name`` is already a model id or alias in llm."""
    check_name(name)
    for found in llm.get_models_with_aliases():
        if name == found.model.model_id or name in found.aliases:
            raise ValueError(f"{name} is already a model id or alias in llm; pick another with --alias")


@paged_mlx.group()
def cache():
    "The disk cache of earlier conversations' KV blocks"


@cache.command(name="info")
def cache_info():
    "Show the KV disk cache's size, blocks per model and hit counts"
    from .engine.disk.admin import directory_info
    from .plugin import kv_disk_dir

    info = directory_info(kv_disk_dir())
    click.echo(f"{info['directory']}: {info['blocks']} blocks, {info['size_bytes'] / 1e6:.1f} MB")
    for model_id, model in info["models"].items():
        click.echo(
            f"  {model_id}: {model['blocks']} blocks, {model['bytes'] / 1e6:.1f} MB, "
            f"{model.get('hits', 0)} blocks reused, {model.get('misses', 0)} lookups stopped at a block not on disk"
        )


@cache.command(name="clear")
def cache_clear():
    "Delete every cached KV block"
    from .engine.disk.admin import clear_directory
    from .plugin import kv_disk_dir

    try:
        removed = clear_directory(kv_disk_dir())
    except TimeoutError as e:
        raise click.ClickException(f"{e} (an llm writing KV blocks, or one suspended with Ctrl-Z); try again later")
    except OSError as e:
        raise click.ClickException(f"could not clear {kv_disk_dir()}: {one_line(e)}")
    click.echo(f"Removed {removed} blocks")
