"""Structured output: JSON schemas as per-request grammars in the batched sampler, from the engine to the CLI.

The engine tests run a tiny random-weight llama over SmolLM2's tokenizer: whatever it would write, the
grammar lets it write only JSON that fits the schema. The schemas bound their strings, numbers and arrays,
so that a model that never chooses to stop still ends within the token limit.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import llm
import mlx.core as mx
import pytest
from faults import Fault, Injector, run_through_faults
from json_schemas import SCHEMAS
from models import tiny_model
from smollm2 import smollm2_dir
from test_engine import collect, random_prompts, reference
from test_plugin import assert_clean_error, ok, run_llm, user_dir  # noqa: F401 (a fixture)

from llm_paged_mlx import Engine, SamplingParams
from llm_paged_mlx.engine import grammar as grammar_module
from llm_paged_mlx.engine import sampler
from llm_paged_mlx.engine.grammar import Grammars, JsonSchemaError, closed
from llm_paged_mlx.engine.request import Request
from llm_paged_mlx.models.loading import load_model

QUESTIONS = [
    "Invent a person.", "Describe a city.", "Name some colors.", "Is the sky blue?", "Invent a person with an address.",
    "Give some points.", "Is all well?", "What is the weather?", "Tag this: a red apple.", "Invent a book.",
]  # fmt: skip


# For a random model, which would write digits without end: schemas whose every value is bounded (a number's
# fraction is not).
BOUNDED = [(s, q) for s, q in zip(SCHEMAS, QUESTIONS) if '"number"' not in json.dumps(s)]


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_objects_that_name_their_properties_take_no_others_unless_they_say():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "e": {"type": "array", "items": {"type": "object"}}},
              "$defs": {"c": {"properties": {"d": {}}}}}  # fmt: skip
    got = closed(schema)
    assert got["additionalProperties"] is False and got["properties"]["a"]["additionalProperties"] is False
    assert got["$defs"]["c"]["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"]["e"]["items"]  # any object stays any object
    assert closed({"properties": {}, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is left alone


# Objects whose properties are named in several places, or not at all: closing them would forbid every answer.
OPEN = [
    {"type": "object", "properties": {"kind": {"enum": ["x", "y"]}}, "required": ["kind"],
     "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]},
               {"properties": {"y": {"type": "integer"}}, "required": ["y"]}]},
    {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                 {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
]  # fmt: skip


@pytest.mark.parametrize("schema", OPEN, ids=["anyOf", "allOf", "required-unnamed"])
def test_objects_named_in_several_places_stay_open_and_compile(tokenizer, schema):
    assert "additionalProperties" not in json.dumps(closed(schema))
    Grammars(tokenizer).matcher(schema)  # satisfiable: no error


@pytest.fixture(scope="module")
def tokenizer():
    return load_model(str(smollm2_dir()))[1]


def test_a_schema_compiles_once_and_each_request_gets_its_own_matcher(tokenizer, monkeypatch):
    grammars = Grammars(tokenizer)
    compiles = Injector(monkeypatch, grammars, "_compile")
    first, second = grammars.matcher(SCHEMAS[0]), grammars.matcher(json.loads(json.dumps(SCHEMAS[0])))
    assert compiles.calls == 1
    start = grammars.bitmask([second])
    assert first.consume_token(tokenizer.encode("{", add_special_tokens=False)[0])
    assert (grammars.bitmask([second]) == start).all() and not (grammars.bitmask([first]) == start).all()
    answer_first = {"type": "object", "properties": {"answer": {"type": "integer"}, "reason": {"type": "string"}},
                    "required": ["answer", "reason"]}  # fmt: skip
    reason_first = dict(answer_first, properties=dict(reversed(answer_first["properties"].items())))
    grammars.matcher(answer_first)
    matcher = grammars.matcher(reason_first)  # the properties in their own order, not the first schema's
    assert all(matcher.consume_token(t) for t in tokenizer.encode('{"reason', add_special_tokens=False))
    monkeypatch.setattr(grammar_module, "COMPILED_SCHEMAS", 2)
    for schema in SCHEMAS[1:3] + SCHEMAS[:1]:
        grammars.matcher(schema)
    assert compiles.calls == 6  # the first schema was the oldest of three


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", vocab_size=49152)


def test_constrained_and_free_requests_share_steps_under_preemption(tiny, tokenizer):
    """Free requests keep mlx-lm's greedy tokens; every constrained one ends in JSON that fits its schema."""
    engine = Engine(tiny, tokenizer, block_size=16, num_blocks=20, max_num_batched_tokens=64)
    prompts = [tokenizer.encode(q) for _, q in BOUNDED]
    params = [SamplingParams(max_tokens=300, json_schema=s) for s, _ in BOUNDED]
    free = [tokenizer.encode("Once upon a time"), tokenizer.encode("The capital of France")]
    free_params = [SamplingParams(max_tokens=40)] * 2
    requests = list(zip(prompts[:5] + free + prompts[5:], params[:5] + free_params + params[5:]))
    ids = [engine.add_request(*r) for r in requests[:4]]
    outputs = {}
    for _ in range(3):
        collect(engine.step(), outputs)
    ids += [engine.add_request(*r) for r in requests[4:]]
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    got = [outputs[i] for i in ids]
    assert engine.stats()["preemptions"] > 0
    for tokens, (schema, _) in zip(got[:5] + got[7:], BOUNDED):
        assert valid(tokenizer.decode(tokens), schema), tokenizer.decode(tokens)
    for prompt, tokens in zip(free, got[5:7]):
        assert tokens == reference(tiny, prompt, 40)
    assert engine.stats()["free_blocks"] == 19


def test_constrained_steps_run_ahead_and_a_failure_making_masks_loses_nothing(tiny, tokenizer, monkeypatch):
    """The next constrained step is launched before the last one's tokens are read (its masks are made while
    it runs); masks that fail to be made after its launch start every request over, with the same outputs."""
    prompts = [tokenizer.encode(q) for _, q in BOUNDED]
    params = [SamplingParams(max_tokens=300, json_schema=s) for s, _ in BOUNDED]
    engine = Engine(tiny, tokenizer, block_size=16, num_blocks=64)
    ahead = Injector(monkeypatch, engine.steps, "run_ahead")
    expected = run_through_faults(engine, prompts, params)
    assert ahead.calls > 10
    assert all(valid(tokenizer.decode(t), s) for t, (s, _) in zip(expected, BOUNDED))

    # On the grammars' thread, on the engine's, and Ctrl-C (unheld) while the forward pass is launched.
    for stage, error in (("bitmask", Fault), ("allowed", Fault), ("launch", KeyboardInterrupt)):
        engine = Engine(tiny, tokenizer, block_size=16, num_blocks=64)
        owner = engine.runner if stage == "launch" else engine.grammars
        fault = Injector(monkeypatch, owner, stage, [2, 9, 30], error)
        assert run_through_faults(engine, prompts, params, (error,)) == expected
        assert fault.failures == 3 and engine.stats()["free_blocks"] == 63


def test_sampled_constrained_requests_fit_their_schemas(tiny, tokenizer):
    engine = Engine(tiny, tokenizer, num_blocks=128)
    params = [SamplingParams(max_tokens=300, temperature=1.0, top_p=0.9, seed=i, json_schema=s)
              for i, (s, _) in enumerate(BOUNDED)]  # fmt: skip
    outputs = engine.generate([q for _, q in BOUNDED], params)
    assert all(o.finish_reason == "stop" and valid(o.text, s) for o, (s, _) in zip(outputs, BOUNDED))


@pytest.mark.parametrize(
    "schema,words",
    [
        ({"type": "objectx"}, ["invalid JSON schema", "objectx"]),
        ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, ["invalid JSON schema"]),
        ({"type": "string", "pattern": "(unclosed"}, ["invalid JSON schema"]),
        ({"$ref": "#"}, ["invalid JSON schema"]),  # a cycle: seen only once the first mask is made
        ({"enum": {1, 2}}, ["invalid JSON schema", "not JSON serializable"]),
    ],
)
def test_a_schema_that_is_no_grammar_is_refused_and_nothing_is_kept(tiny, tokenizer, schema, words):
    engine = Engine(tiny, tokenizer, num_blocks=32)
    with pytest.raises(JsonSchemaError) as error:
        engine.add_request("Hi", SamplingParams(json_schema=schema))
    assert all(word in str(error.value) for word in words)
    assert not engine.has_unfinished() and engine.stats()["free_blocks"] == 31
    with pytest.raises(ValueError, match="json_schema must be a JSON schema as a dict"):
        SamplingParams(json_schema="name, age int")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        Engine(tiny, None, num_blocks=32).add_request([1, 2, 3], SamplingParams(json_schema={"type": "object"}))


def test_llm_schema_gives_json_that_fits_for_ten_schemas(user_dir):  # noqa: F811
    """``llm --schema`` with the first schema; the other nine through llm's Python API (``schema=``: the same
    ``prompt.schema`` that the plugin turns into the request's grammar), all at once, so that they share steps."""
    output = ok("-m", "paged-smollm2", "--schema", json.dumps(SCHEMAS[0]), "-o", "max_tokens", 300, QUESTIONS[0])
    assert valid(output, SCHEMAS[0]), (SCHEMAS[0], output)
    model = llm.get_model("paged-smollm2")
    ask = lambda schema, question: model.prompt(question, schema=schema, max_tokens=300).text()  # noqa: E731
    with ThreadPoolExecutor(len(SCHEMAS) - 1) as pool:
        outputs = list(pool.map(ask, SCHEMAS[1:], QUESTIONS[1:]))
    for schema, output in zip(SCHEMAS[1:], outputs):
        assert valid(output, schema), (schema, output)


def test_llm_schema_errors_are_clean(user_dir):  # noqa: F811
    result = run_llm("-m", "paged-smollm2", "--schema", '{"type": "objectx"}', "Hi")
    assert_clean_error(result, "invalid JSON schema", "objectx")


# -- logit_bias in the batched sampler, and the sampling parameters' checks ---------------------


def test_logit_bias_changes_only_its_own_requests_tokens_in_a_shared_batch():
    """Biased and unbiased requests share steps: each unbiased one keeps the tokens it gets alone (greedy:
    mlx-lm's); a bias of 100 makes its token the only one taken, -100 bans the one greedy takes first."""
    model = tiny_model("llama")
    prompts = random_prompts([5, 9, 13, 7], seed=3)
    greedy = [reference(model, p, 12) for p in prompts]
    banned = greedy[1][0]
    params = [
        SamplingParams(max_tokens=12),
        SamplingParams(max_tokens=12, logit_bias={banned: -100}),
        SamplingParams(max_tokens=12, logit_bias={7: 100, 10**6: 5}),  # 10**6: past the logits, nothing to bias
        SamplingParams(max_tokens=12, temperature=1.0, seed=5),
    ]
    alone = Engine(model, num_blocks=32).generate([prompts[3]], [params[3]])[0].token_ids
    outputs = Engine(model, num_blocks=64).generate(prompts, params)
    assert outputs[0].token_ids == greedy[0] and outputs[3].token_ids == alone
    assert len(outputs[1].token_ids) == 12 and banned not in outputs[1].token_ids
    assert outputs[2].token_ids == [7] * 12


def test_a_bias_is_added_to_its_row_and_a_batch_without_one_takes_the_sampler_as_before(monkeypatch):
    logits = mx.array([[0.0, 1.0, 2.0]] * 2, dtype=mx.bfloat16)
    rows = [Request(i, [1], SamplingParams(logit_bias=bias), max_total_tokens=8)
            for i, bias in enumerate([{0: 2.5}, None])]  # fmt: skip
    assert sampler.sample(logits, rows).tolist() == [0, 2]  # 0 + 2.5 beats 2
    monkeypatch.setattr(sampler, "_biased", None)  # calling it would fail
    assert sampler.sample(logits, rows[1:] * 2).tolist() == [2, 2]


@pytest.mark.parametrize("field, value", [
    ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", -0.5), ("temperature", "1"),
    ("top_p", float("nan")), ("top_p", float("inf")), ("top_p", 0),
    ("min_p", float("nan")), ("min_p", float("inf")), ("min_p", -0.1),
    ("top_k", float("inf")), ("top_k", float("nan")), ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("seed", 1.5),
    ("logit_bias", {"5": 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: 101}),
    ("logit_bias", {5: float("nan")}), ("logit_bias", {5: True}), ("logit_bias", [(5, 1.0)]),
])  # fmt: skip
def test_sampling_params_refuse_what_no_sampler_can_use_naming_the_field(field, value):
    """Not uniform noise (temperature inf), nor a step that fails for every request in it (top_k 2.5, seed 1.5)."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_take_numbers_of_any_kind_in_range():
    import numpy as np

    params = SamplingParams(temperature=2, top_p=np.float32(0.5), top_k=np.int64(3), min_p=0, seed=np.int64(-4),
                            logit_bias={np.int64(5): -100, 6: 100.0, 7: 0})  # fmt: skip
    assert params.top_k == 3 and params.logit_bias[5] == -100
