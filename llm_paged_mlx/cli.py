"""The ``llm paged-mlx`` commands: register, list, import and remove the plugin's models; serve one over HTTP."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import llm

from .parallel import ranks
from .catalog import BUILTIN_MODELS, builtin_models, fetch_smollm2, imported_dir, kv_disk_dir, registered_models, user_models
from .engines import ModelLoadError, engine_builder
from .errors import one_line
from .options import parse_size
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
        name = _alias(name, Path(source).name)
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
            shutil.rmtree(imported_folder(imported_dir(), name, entry["source"]), ignore_errors=True)
        except ValueError as e:
            click.echo(f"{entry['source']} not deleted: {e}")
    click.echo(f"Removed {name}")


@paged_mlx.command(name="import-gguf")
@click.argument("gguf_file", type=click.Path(path_type=Path))
@click.option("--alias", "name", help="Model id for llm -m (default: the file name without .gguf)")
def import_gguf(gguf_file, name):
    "Convert a llama-architecture GGUF file into an MLX folder and register it"
    from .models.gguf import convert_gguf

    try:
        name = _alias(name, gguf_file.name.removesuffix(".gguf"))
        target = imported_dir() / name
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


def _alias(given: str | None, default: str) -> str:
    """The model id ``--alias`` gives, else ``default``; an empty one is a mistake (a variable left unset, say),
    not a request for the default."""
    if given is None:
        return default
    if not given.strip():
        raise ValueError(f"--alias {given!r} is empty: give a model id, or leave --alias out to use {default!r}")
    return given


def _check_unused(name: str) -> None:
    """ValueError if ``name`` is already a model id or alias in llm."""
    check_name(name)
    for found in llm.get_models_with_aliases():
        if name == found.model.model_id or name in found.aliases:
            raise ValueError(f"{name} is already a model id or alias in llm; pick another with --alias")


API_KEY_ENV = "LLM_PAGED_MLX_API_KEY"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# A server's engine options where -o does not set them: as many sequences in a step as vLLM's default, and no
# KV disk tier (a server keeps its prefix cache in memory; writing every finished request's K/V to disk costs
# a server with many clients much of its throughput: benchmarks/RESULTS.md).
SERVE_DEFAULTS = {"max_num_seqs": "256", "kv_disk_budget": "0"}


@paged_mlx.command()
@click.argument("model_id")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on")
@click.option("--api-key", envvar=API_KEY_ENV, help=f"Require this bearer token on /v1 (or set ${API_KEY_ENV})")
@click.option("options", "-o", "--option", type=(str, str), multiple=True,
              help="A model option, e.g. -o kv_budget 4GB; sampling options set request defaults. "
                   "Unlike llm's, max_num_seqs defaults to 256 and kv_disk_budget to 0 (no disk tier)")
@click.option("--max-waiting", default=1024, show_default=True, type=click.IntRange(1),
              help="Requests that may wait for the engine; more get 503")
@click.option("--max-body", default="32MB", show_default=True, help="Largest request body")
@click.option("--tensor-parallel", default=1, show_default=True, type=click.IntRange(1),
              help="Shard the model over this many processes (GPUs, or Macs with --hostfile), started "
                   "through mlx.launch; rank 0 serves HTTP")
@click.option("--backend", type=click.Choice(["ring", "nccl", "jaccl"]),
              help="mx.distributed backend for --tensor-parallel (default: nccl with CUDA, else ring)")
@click.option("--hostfile", type=click.Path(exists=True, dir_okay=False),
              help="mlx.launch's hostfile: the machines to run the ranks on (default: this one)")
def serve(model_id, host, port, api_key, options, max_waiting, max_body, tensor_parallel, backend, hostfile):
    "Serve a model over an OpenAI-compatible HTTP API (chat, completions, models, metrics)"
    from .server import run

    group = None
    try:
        max_body_bytes = parse_size(max_body)
        if tensor_parallel > 1:
            if ranks.LAUNCHED_RANK not in os.environ:  # check here what every rank would refuse, then start them
                _find_model(model_id)
                _parse_options(dict(options))
                _check_port(host, port)
                raise SystemExit(_launch_ranks(tensor_parallel, backend, hostfile))
            group = ranks.join(tensor_parallel, backend)
            if group.rank() != 0:
                return _follow(model_id, options, group)
        served = _served_model(model_id, dict(options), max_waiting, group)
    except (ValueError, ModelLoadError) as e:
        raise click.ClickException(one_line(e))
    if host not in LOCAL_HOSTS and not api_key:
        click.echo(f"Warning: serving on {host} without an API key: anyone who can reach this port can use the model. "
                   f"Set one with --api-key or ${API_KEY_ENV}.", err=True)
    click.echo(f"Serving {served.model_id} on http://{host}:{port}/v1", err=True)
    run(served, host, port, api_key=api_key or None, max_body_bytes=max_body_bytes)


RANK_EXIT_WAIT_S = 10.0  # after one rank failed, how long the others may take to end before they are killed


def _launch_ranks(size: int, backend, hostfile) -> int:
    """Run this same command as ``size`` ranks; the first failed rank's exit status, or 0.

    On this machine the ranks are started here, as ``mlx.launch -n`` would start them (its own loop
    would keep a core busy, and it ends with 0 whatever its ranks end with); on ``hostfile``'s machines,
    through ``mlx.launch``. Ctrl-C in a terminal reaches every rank (rank 0 stops the server and tells
    the others); SIGTERM and SIGHUP to this process are passed to rank 0 (or to ``mlx.launch``). When a
    rank fails, the others are ended.
    """
    backend = backend or ranks.default_backend()
    command = [sys.executable, *sys.orig_argv[1:]]
    if hostfile:
        launcher = Path(sys.executable).with_name("mlx.launch")
        if not launcher.is_file():
            raise ValueError(f"--hostfile needs mlx.launch beside {sys.executable} (it comes with mlx)")
        started = [subprocess.Popen([str(launcher), "--backend", backend, "--hostfile", hostfile, "--", *command])]
        return _wait_for_ranks(started)
    with tempfile.TemporaryDirectory(prefix="llm-paged-mlx-ranks-") as folder:
        envs = ranks.local_env(size, backend, folder)
        return _wait_for_ranks([subprocess.Popen(command, env={**os.environ, **env}) for env in envs])


def _wait_for_ranks(started: list) -> int:
    """Wait for every rank; pass SIGTERM and SIGHUP to the first; end the others once one fails."""
    lead = started[0]
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: lead.send_signal(signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the ranks themselves
    failed = None  # when a rank first failed
    while True:
        running = [rank for rank in started if rank.poll() is None]
        codes = [rank.returncode for rank in started if rank.returncode not in (None, 0)]
        if codes and failed is None:
            failed = time.monotonic()
            number = next(r for r, rank in enumerate(started) if rank.returncode not in (None, 0))
            if running:
                click.echo(f"llm-paged-mlx: rank {number} ended with status {codes[0]}; ending the others", err=True)
            for rank in running:
                rank.terminate()
        if not running:
            code = codes[0] if codes else 0
            return code if code >= 0 else 128 - code  # killed by a signal: 128 + its number, as a shell says
        if failed is not None and time.monotonic() - failed > RANK_EXIT_WAIT_S:
            for rank in running:
                rank.kill()
        time.sleep(0.1)


def _check_port(host: str, port: int) -> None:
    """ValueError if ``host:port`` cannot be listened on (checked before the ranks load the model)."""
    try:
        socket.create_server((host, port)).close()
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _stop_serving(failure: Exception) -> None:
    """On rank 0, once its group failed: stop the server, as SIGTERM would (no request can run any more)."""
    click.echo(f"llm-paged-mlx: {failure}; stopping the server", err=True)
    os.kill(os.getpid(), signal.SIGTERM)


def _follow(model_id: str, options, group) -> None:
    """A rank other than 0: check what rank 0 checks, then ``ranks.replay`` its engine calls."""
    _, _, fetch, _ = _find_model(model_id)
    _parse_options(dict(options))  # the same errors as rank 0's, before rank 0 asks for an engine
    build = engine_builder(model_id, fetch, group)

    def build_for_good(*args):  # this process keeps the engine until it ends, as rank 0's server does
        from .engine.loop import freeze_heap

        engine = build(*args)
        freeze_heap()
        return engine

    ranks.replay(build_for_good, group)


def _find_model(name: str):
    """``(model_id, source, fetch, aliases)`` of the model ``name`` names: a model id or alias of this
    plugin's, or an mlx-lm model folder."""
    model_id, aliases = name, []
    for found in llm.get_models_with_aliases():
        if name == found.model.model_id or name in found.aliases:
            model_id, aliases = found.model.model_id, found.aliases
    ours = {**builtin_models(), **registered_models()}
    if model_id in ours:
        source, fetch = ours[model_id]
    elif aliases or model_id in {m.model_id for m in llm.get_models()}:
        raise ValueError(f"{name} is not an llm-paged-mlx model (see: llm paged-mlx list)")
    elif (Path(name) / "config.json").is_file():
        model_id, source = Path(name).resolve().name, str(Path(name).resolve())
        fetch = lambda: source  # noqa: E731
    else:
        raise ValueError(f"{name} is neither a model of llm-paged-mlx nor a model folder (see: llm paged-mlx list)")
    return model_id, source, fetch, tuple(a for a in aliases if a != model_id)


def _parse_options(options: dict):
    """The serve command's options, over its defaults."""
    from pydantic import ValidationError

    from .options import PagedOptions, serving_config

    if "tensor_parallel" in options:
        raise ValueError("option tensor_parallel: serve takes --tensor-parallel N instead")
    try:
        parsed = PagedOptions(**{**SERVE_DEFAULTS, **options})
    except ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"option {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    serving_config(parsed)  # what the engine's config refuses, before any rank starts
    return parsed


def _served_model(name: str, options: dict, max_waiting: int, group=None):
    """The model ``name`` names, loaded (sharded over ``group``, on its rank 0, if given)."""
    from .engines import engine_loop
    from .options import sampling_params, serving_config
    from .server import ServedModel

    model_id, source, fetch, aliases = _find_model(name)
    parsed = _parse_options(options)
    config = serving_config(parsed)
    defaults = {k: v for k, v in vars(sampling_params(parsed)).items() if k in options or k == "max_tokens"}
    loop = engine_loop(model_id, source, fetch, max_waiting=max_waiting, group=group, on_group_failure=_stop_serving)
    click.echo(f"Loading {model_id}...", err=True)
    loop.prepare(config).result()
    context = loop.engine.max_context or loop.engine.max_blocks * loop.engine.blocks.block_size
    return ServedModel(model_id, loop, config, aliases, defaults, context)


@paged_mlx.group()
def cache():
    "The disk cache of earlier conversations' KV blocks"


@cache.command(name="info")
def cache_info():
    "Show the KV disk cache's size, blocks per model and hit counts"
    from .engine.disk.admin import directory_info

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

    try:
        removed = clear_directory(kv_disk_dir())
    except TimeoutError as e:
        raise click.ClickException(f"{e} (an llm writing KV blocks, or one suspended with Ctrl-Z); try again later")
    except OSError as e:
        raise click.ClickException(f"could not clear {kv_disk_dir()}: {one_line(e)}")
    click.echo(f"Removed {removed} blocks")
