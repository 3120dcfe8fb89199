"""Plugins: a real third-party package (tests/plugin_pkg) found through its entry point, and registry lookups.

``make test`` installs tests/plugin_pkg (``pip install -e tests/plugin_pkg``); these tests fail without it.
"""

from importlib.metadata import entry_points

import pytest
from models import tiny_model

from llm_paged_mlx import Engine, SamplingParams, plugins

ENTRY_POINT = "shortest_first"  # the entry-point name in tests/plugin_pkg/pyproject.toml
PROMPT_LENGTHS = [30, 5, 17, 2, 9]


@pytest.fixture(autouse=True)
def fresh_plugin_manager():
    """``get_plugin_manager`` is cached: start and leave every test with a fresh one."""
    plugins.get_plugin_manager.cache_clear()
    yield
    plugins.get_plugin_manager.cache_clear()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def finish_order(engine, prompts):
    """Request indices in the order the engine finishes them (each runs to ``max_tokens=2``)."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    order = []
    while engine.has_unfinished():
        order += [ids.index(chunk.request_id) for chunk in engine.step() if chunk.finish_reason]
    return order


def prompts_of(lengths):
    return [[(7 * n + i) % 256 for i in range(n)] for n in lengths]


def test_plugin_is_installed_with_its_entry_point():
    found = {ep.name: ep for ep in entry_points(group="llm_paged_mlx")}
    assert ENTRY_POINT in found, "tests/plugin_pkg is not installed: run `pip install -e tests/plugin_pkg`"
    assert found[ENTRY_POINT].value == "llm_paged_mlx_shortest_first"


def test_plugin_registers_its_scheduler_through_the_entry_point():
    import llm_paged_mlx_shortest_first

    pm = plugins.get_plugin_manager()
    assert pm.get_plugin(ENTRY_POINT) is llm_paged_mlx_shortest_first
    registry = plugins.schedulers()
    assert {"fcfs", "priority", "shortest-first"} <= set(registry)
    assert registry["shortest-first"] is llm_paged_mlx_shortest_first.ShortestFirst


def test_shortest_first_serves_prompts_in_order_of_length(model):
    prompts = prompts_of(PROMPT_LENGTHS)
    engine = Engine(model, scheduler="shortest-first", max_num_seqs=1, num_blocks=64, block_size=16)
    assert finish_order(engine, prompts) == sorted(range(len(prompts)), key=lambda i: PROMPT_LENGTHS[i])


def test_shortest_first_breaks_ties_by_arrival(model):
    lengths = [8, 3, 8, 3]
    engine = Engine(model, scheduler="shortest-first", max_num_seqs=1, num_blocks=64, block_size=16)
    assert finish_order(engine, prompts_of(lengths)) == [1, 3, 0, 2]


def test_fcfs_serves_the_same_prompts_in_arrival_order(model):
    prompts = prompts_of(PROMPT_LENGTHS)
    engine = Engine(model, scheduler="fcfs", max_num_seqs=1, num_blocks=64, block_size=16)
    order = finish_order(engine, prompts)
    assert order == list(range(len(prompts)))
    assert order != sorted(order, key=lambda i: PROMPT_LENGTHS[i])


@pytest.mark.parametrize(
    "allowed, loaded",
    [("", False), (ENTRY_POINT, True), (f" other , {ENTRY_POINT} ", True), ("other", False)],
)
def test_load_plugins_env_var_limits_what_loads(monkeypatch, allowed, loaded):
    monkeypatch.setenv("LLM_PAGED_MLX_LOAD_PLUGINS", allowed)
    plugins.get_plugin_manager.cache_clear()
    registry = plugins.schedulers()
    assert {"fcfs", "priority"} <= set(registry)  # built-ins always load
    assert ("shortest-first" in registry) is loaded
    assert (plugins.get_plugin_manager().get_plugin(ENTRY_POINT) is not None) is loaded


def test_engine_cannot_use_a_scheduler_whose_plugin_is_not_loaded(monkeypatch, model):
    monkeypatch.setenv("LLM_PAGED_MLX_LOAD_PLUGINS", "")
    plugins.get_plugin_manager.cache_clear()
    with pytest.raises(ValueError, match="'shortest-first'"):
        Engine(model, scheduler="shortest-first", num_blocks=8)


@pytest.mark.parametrize(
    "option, kind",
    [("scheduler", "scheduler"), ("swap_policy", "swap policy"), ("attention_kernel", "attention kernel")],
)
def test_unknown_names_raise_value_error_naming_them(model, option, kind):
    with pytest.raises(ValueError, match=f"unknown {kind} 'no-such-thing'"):
        Engine(model, num_blocks=8, **{option: "no-such-thing"})


def test_registering_a_name_twice_is_an_error():
    from llm_paged_mlx import hookimpl

    class Duplicate:
        @hookimpl
        def register_schedulers(self, register):
            register("fcfs", object)

    pm = plugins.get_plugin_manager()
    pm.register(Duplicate(), "duplicate")
    with pytest.raises(ValueError, match="'fcfs' is registered twice"):
        plugins.schedulers()
