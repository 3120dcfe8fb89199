"""The package's layout as a newcomer reads it: no import circle, and only the plugin layer imports llm."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llm_paged_mlx"


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Every module of the package and what it imports (every import statement, functions' too): the
    package's modules, and the top-level names of others."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    inside, outside = {m: set() for m in modules}, {m: set() for m in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".")
                base = base if node.level else node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules:
                    inside[name].add(target)
                else:
                    outside[name].add(target.split(".")[0])
    return inside, outside


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles: strongly connected components of more than one module, or a module importing itself."""
    index, low, stack, found = {}, {}, [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_circle():
    inside, _ = import_graph()
    assert "llm_paged_mlx.engine.engine" in inside["llm_paged_mlx.engines"]  # the graph sees imports in functions
    assert cycles(inside) == []


def test_only_the_plugin_layer_imports_llm():
    """The engine core runs wherever MLX runs: llm is the plugin's and its commands' alone."""
    _, outside = import_graph()
    importers = {module for module, names in outside.items() if "llm" in names}
    assert importers == {"llm_paged_mlx.plugin", "llm_paged_mlx.cli"}


def test_python_m_runs_the_paged_mlx_commands():
    command = [sys.executable, "-m", "llm_paged_mlx", "--help"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout and "Usage: python -m llm_paged_mlx" in result.stdout


# What a newcomer can read in one sitting (issue S): the package's limits, in lines as ``ast`` counts them.
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 500, 400, 60


def oversized(path: Path) -> list[str]:
    """The module itself, its classes and its functions (methods and nested ones too) past their limits."""
    source = path.read_text()
    found = [f"{path.name}: {source.count(chr(10))} lines"] if source.count("\n") > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(source)):
        limit = {ast.ClassDef: MAX_CLASS_LINES, ast.FunctionDef: MAX_FUNCTION_LINES,
                 ast.AsyncFunctionDef: MAX_FUNCTION_LINES}.get(type(node))  # fmt: skip
        if limit is not None and node.end_lineno - node.lineno + 1 > limit:
            found.append(f"{path.name}: {node.name} {node.end_lineno - node.lineno + 1} lines")
    return found


def test_oversized_code_is_found(tmp_path):
    path = tmp_path / "long.py"
    path.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "\n\nclass C:\n    pass\n")
    assert oversized(path) == [f"long.py: f {MAX_FUNCTION_LINES + 1} lines"]


def test_no_module_class_or_function_is_past_its_limit():
    assert [found for path in sorted(PACKAGE.rglob("*.py")) for found in oversized(path)] == []
