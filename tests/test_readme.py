"""The README's examples, run as written, offline, against the default SmolLM2.

Every ```bash block of README.md runs, in the README's order, and then every ```python block, in a
temporary folder with a temporary LLM_USER_PATH and HOME, except a block that needs what a test here
cannot have; the rule (SKIPS) is what the block names:

- ``make ...`` or ``sudo ...`` at the start of a line: the set-up itself (this file runs under ``make test``);
- ``mlx-community/`` or ``paged-qwen``: a model from the Hugging Face hub (the tests run offline);
- ``tensor_parallel``, ``--tensor-parallel`` or ``mlx.launch``: the ranks of a tensor-parallel group.

In the blocks that run:

- ``llm`` and ``.venv/bin/`` are those of the Python that runs the tests;
- the files the examples name exist: ``~/models/my-mlx-model`` is SmolLM2's folder, ``model.Q4_0.gguf``
  a tiny llama in GGUF;
- a shell block is one command a line (a line that leaves a quote open goes on to the next), with an
  empty stdin, but for ``llm chat``, which reads a question and then ``exit``;
- ``llm paged-mlx serve`` starts in the background on a free port, which stands for 8000 there and in
  the blocks after it (curl, OpenAI's client), and stops when this file's tests end;
- the Python blocks run one after the other in one interpreter, each seeing what the blocks before it
  defined (the ``EngineLoop`` example uses the engine example's model); a block that starts with
  ``# NAME.py`` is a file: it is written as NAME.py and imported.

Every command must exit with 0 and every Python block run to its end; what the README says of an
answer must hold (the question about France gets "The capital of France is Paris."), and each
``--schema`` command must print JSON that fits its schema.
"""

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
from llm.utils import schema_dsl
from smollm2 import MODEL_CACHE, smollm2_dir
from test_gguf import tiny_metadata, tiny_weights, write_gguf

from llm_paged_mlx.catalog import CACHE_ENV

README = Path(__file__).parent.parent / "README.md"
BIN = Path(sys.executable).parent
SKIPS = [
    (re.compile(r"^(make|sudo) ", re.MULTILINE), "the set-up itself (this file runs under make test)"),
    (re.compile(r"mlx-community/|paged-qwen"), "a model from the Hugging Face hub (the tests run offline)"),
    (re.compile(r"tensor_parallel|--tensor-parallel|mlx\.launch"), "the ranks of a tensor-parallel group"),
]
SERVE = "llm paged-mlx serve "
FRANCE = 'llm -m paged-smollm2 "What is the capital of France?"'
CHAT_INPUT = "What is the capital of France?\nexit\n"
FILE_BLOCK = re.compile(r"# (\w+)\.py\n")


@dataclass
class Block:
    line: int  # of its first line of code in README.md
    language: str
    code: str

    @property
    def skip(self):
        return next((reason for rule, reason in SKIPS if rule.search(self.code)), None)

    def __str__(self):
        return f"README.md:{self.line}"


def readme_blocks(language: str) -> list[Block]:
    """README.md's fenced blocks of ``language``, in order."""
    lines = README.read_text().splitlines(keepends=True)
    blocks, start, fenced = [], None, None
    for number, line in enumerate(lines, 1):
        if start is None and line.startswith("```"):
            start, fenced = number + 1, line[3:].strip()
        elif start is not None and line == "```\n":
            if fenced == language:
                blocks.append(Block(start, language, "".join(lines[start - 1:number - 1])))
            start = None
    return blocks


def commands(block: Block) -> list[str]:
    """A shell block's commands: one a line, but a line that leaves a quote open goes on to the next."""
    found, pending = [], ""
    for line in block.code.splitlines():
        pending += line + "\n"
        try:
            if shlex.split(pending, comments=True):
                found.append(pending.strip())
            pending = ""
        except ValueError:  # a quote still open
            continue
    assert not pending, f"{block}: a quote is never closed"
    return found


def params(blocks: list[Block]):
    return [pytest.param(block, id=str(block),
                         marks=[pytest.mark.skip(reason=block.skip)] if block.skip else []) for block in blocks]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The folder the examples run in and their environment, with the files they name."""
    root = tmp_path_factory.mktemp("readme")
    home = root / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "my-mlx-model").symlink_to(smollm2_dir())
    work = root / "work"
    work.mkdir()
    write_gguf(work / "model.Q4_0.gguf", tiny_metadata(),
               {name: ("Q4_0" if w.ndim == 2 else "F32", w) for name, w in tiny_weights().items()})
    env = {**os.environ, "HOME": str(home), "LLM_USER_PATH": str(root / "llm"), CACHE_ENV: str(MODEL_CACHE),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    return work, env


@pytest.fixture(scope="module")
def server(workspace):
    """The README's `llm paged-mlx serve` command, running on a free port (the port it listens on)."""
    work, env = workspace
    (block,) = [b for b in readme_blocks("bash") if b.code.startswith(SERVE) and not b.skip]
    (command,) = commands(block)
    argv = shlex.split(command, comments=True)
    argv[argv.index("--port") + 1] = "0"  # the kernel picks; the server says which
    process = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    lines = queue.SimpleQueue()

    def read_stderr():
        for line in process.stderr:
            lines.put(line)
        lines.put("")  # the end

    threading.Thread(target=read_stderr, daemon=True).start()
    seen = ""
    while not (listening := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", seen)):
        line = lines.get(timeout=300)
        assert line, f"{block}: the server ended before it listened:\n{seen}"
        seen += line
    yield int(listening[1])
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0, seen


def with_port(code: str, port: int) -> str:
    return code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def run_command(command: str, block: Block, work: Path, env: dict) -> str:
    command = command.replace(".venv/bin/", f"{BIN}/")
    stdin = CHAT_INPUT if command.startswith("llm chat") else ""
    run = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=work, env=env, input=stdin,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{block}: {command}\nexited with {run.returncode}:\n{run.stdout}\n{run.stderr}"
    return run.stdout


def check_schema_answer(argv: list[str], output: str, block: Block) -> None:
    """An `llm --schema` command's output is JSON that fits its schema, and not `{}`."""
    if "--schema" in argv:
        given = argv[argv.index("--schema") + 1]
        schema = json.loads(given) if given.startswith("{") else schema_dsl(given)
        jsonschema.validate(json.loads(output), schema)
        assert json.loads(output), f"{block}: an empty answer to {given}"


@pytest.mark.parametrize("block", params(readme_blocks("bash")))
def test_shell_example(block, workspace, request):
    work, env = workspace
    if block.code.startswith(SERVE):
        request.getfixturevalue("server")  # the command runs in the background, for the blocks after it
        return
    port = request.getfixturevalue("server") if "127.0.0.1:8000" in block.code else None
    for command in commands(block):
        output = run_command(with_port(command, port) if port else command, block, work, env)
        if command.startswith(FRANCE):
            assert output == "The capital of France is Paris.\n", f"{block}: {command}\n{output}"
        if command.startswith("curl "):
            assert json.loads(output)["choices"][0]["message"]["content"], output
        check_schema_answer(shlex.split(command, comments=True), output, block)


DRIVER = """
import json, sys
namespace = {"__name__": "__main__"}
for line, code in json.load(sys.stdin):
    exec(compile("\\n" * (line - 1) + code, "README.md", "exec"), namespace)
"""


def test_python_examples(workspace, server):
    """Every Python block that is not skipped, in order, in one interpreter (tracebacks name README.md's lines)."""
    work, env = workspace
    blocks = [block for block in readme_blocks("python") if not block.skip]
    assert blocks, "the README has no Python example to run"
    program = []
    for block in blocks:
        if file := FILE_BLOCK.match(block.code):
            (work / f"{file[1]}.py").write_text(block.code)
            program.append((block.line, f"import {file[1]}"))
        else:
            program.append((block.line, with_port(block.code, server)))
    run = subprocess.run([sys.executable, "-c", DRIVER], cwd=work, env=env, input=json.dumps(program),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
