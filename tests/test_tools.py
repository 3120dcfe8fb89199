"""Tool calls: read from generated text in the model's chat format, and llm's tool loop through the CLI.

The loop runs on a scripted model: a tiny llama whose layers run as usual (so
the engine pages their K/V) and whose next token follows a script of the
current one, with a word-level tokenizer and a chat template in the format
mlx-lm reads as JSON tool calls (``<tool_call>{...}</tool_call>``). After its
template's ``CALL`` it calls ``llm_time``; after ``ANSWER`` (the template's
generation prompt after a tool result) it answers ``It is late.``.
"""

import json

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.tool_parsers import json_tools, mistral
from mlx_lm.utils import save_config, save_model
from test_plugin import assert_clean_error, ok, run_llm, user_dir  # noqa: F401 (a fixture)
from test_server import Running
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llm_paged_mlx import chat, engines
from llm_paged_mlx.models import loading
from llm_paged_mlx.options import PagedOptions, serving_config
from llm_paged_mlx.server import ServedModel, create_app
from llm_paged_mlx.tool_calls import ToolCall, ToolCallReader

# -- reading calls out of generated text --------------------------------------------------------


class FormatOf:
    """The tool-call markers and parser of one of mlx-lm's formats, as a tokenizer carries them."""

    def __init__(self, module):
        self.tool_call_start, self.tool_call_end = module.tool_call_start, module.tool_call_end
        self.tool_parser = module.parse_tool_call


def read(fmt, pieces):
    reader = ToolCallReader(FormatOf(fmt))
    text = "".join(reader.feed(piece) for piece in pieces) + reader.finish()
    return text, reader.calls


def test_calls_are_taken_out_of_the_text_wherever_the_pieces_break():
    generated = (
        'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
        ' and <tool_call>{"name": "g"}</tool_call>!'
    )
    want = ("Sure.  and !", [ToolCall("f", {"x": 1}), ToolCall("g", {})])
    for size in (1, 2, 3, 7, len(generated)):  # markers split across pieces, or whole
        assert read(json_tools, [generated[i : i + size] for i in range(0, len(generated), size)]) == want


def test_a_call_that_does_not_parse_is_given_back_as_text():
    assert read(json_tools, ["a <tool_call>{not json</tool_call> b"]) == ("a <tool_call>{not json</tool_call> b", [])
    assert read(json_tools, ['<tool_call>{"arguments": {}}</tool_call>']) == (
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        [],
    )
    # cut off by the token limit: the open call is text, without an end marker the model never wrote
    assert read(json_tools, ['<tool_call>{"name": "f", "argu']) == ('<tool_call>{"name": "f", "argu', [])


def test_a_call_too_deep_to_parse_is_given_back_as_text():
    deep = "<tool_call>" + "[" * 5000 + "</tool_call>"  # json.loads raises RecursionError
    assert read(json_tools, [deep]) == (deep, [])


def test_a_format_without_an_end_marker_ends_its_calls_with_the_text():
    text, calls = read(mistral, ['Checking.[TOOL_CALLS][{"name": "f", "arguments": "{\\"a\\": [1]}"}]'])
    assert text == "Checking." and calls == [ToolCall("f", {"a": [1]})]  # arguments given as JSON text are read


def test_text_that_only_looks_like_a_marker_is_kept():
    assert read(json_tools, ["a <tool", "_ca", "ll b <tool_cal"]) == ("a <tool_call b <tool_cal", [])


# -- llm's tool loop on a scripted model ----------------------------------------------------------

CALL_JSON = '{"name": "llm_time", "arguments": {}}'
MARKERS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "CALL", "ANSWER", CALL_JSON]
WORDS = ["[UNK]", "It", "is", "late.", "user", "assistant", "system", "tool"]
SCRIPT = {  # token -> the token after it; any other -> <|im_end|>
    "CALL": "<tool_call>",
    "<tool_call>": CALL_JSON,
    CALL_JSON: "</tool_call>",
    "ANSWER": "It",
    "It": "is",
    "is": "late.",
}
TEMPLATE = (
    "{%- if tools %}<|im_start|>system tools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>"
    "{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}"
    "{%- for tool_call in m.tool_calls or [] %}{% set tool_call = tool_call.function %}"
    " <tool_call> {{ tool_call.name }} </tool_call>{% endfor %}<|im_end|>{% endfor %}"
    "{%- if add_generation_prompt %}{% if messages[-1].role == 'tool' %}ANSWER{% else %}CALL{% endif %}{% endif %}"
)


class ScriptedLlama(llama.Model):
    """A llama whose next token is ``script[token]``; its layers still run, so the engine pages their K/V."""

    script: np.ndarray

    def __call__(self, inputs, cache=None, **kwargs):
        logits = super().__call__(inputs, cache=cache, **kwargs)
        forced = mx.array(self.script)[inputs]
        return mx.where(mx.arange(logits.shape[-1]) == forced[..., None], 30.0, -30.0) + 0 * logits


def scripted_folder(folder):
    """An mlx-lm folder of a tiny llama with the word-level tokenizer and tool-call template above."""
    vocab = {token: i for i, token in enumerate(WORDS + MARKERS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_tokens([AddedToken(m, normalized=False) for m in MARKERS if m != "<|im_end|>"])
    tokenizer.add_special_tokens([AddedToken("<|im_end|>", normalized=False)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", unk_token="[UNK]")
    wrapped.chat_template = TEMPLATE
    wrapped.save_pretrained(folder)
    config = dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-5, vocab_size=len(vocab), rope_theta=10000.0,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(folder, model)
    save_config(config, folder / "config.json")
    return vocab


def load_scripted_from(folder, monkeypatch):
    """Have ``load_model`` give the scripted model for ``folder`` (made by ``scripted_folder``)."""
    vocab = scripted_folder(folder)
    script = np.full(len(vocab), vocab["<|im_end|>"], dtype=np.int32)
    for token, after in SCRIPT.items():
        script[vocab[token]] = vocab[after]
    load = loading.load_model

    def load_scripted(path, **kwargs):
        model, tokenizer = load(path, **kwargs)
        if str(path) != str(folder):
            return model, tokenizer
        scripted = ScriptedLlama(model.args)
        scripted.load_weights(tree_flatten(model.parameters()))
        scripted.script = script
        return scripted, tokenizer

    monkeypatch.setattr(loading, "load_model", load_scripted)


@pytest.fixture
def scripted(user_dir, tmp_path, monkeypatch):  # noqa: F811 (user_dir is test_plugin's fixture)
    """``llm -m scripted``: the scripted model; returns the messages of every prompt it renders."""
    folder = tmp_path / "scripted"
    folder.mkdir()
    load_scripted_from(folder, monkeypatch)
    seen = []
    render = chat.render_prompt

    def spy(tokenizer, messages, tools=None):
        seen.append(json.loads(json.dumps(messages)))
        return render(tokenizer, messages, tools)

    monkeypatch.setattr(chat, "render_prompt", spy)
    ok("paged-mlx", "add", folder, "--alias", "scripted")
    return seen


def test_llm_runs_a_tool_loop_on_the_paged_model(scripted):
    output = ok("-m", "scripted", "-T", "llm_time", "--td", "-o", "block_size", 4, "What time is it?")
    assert "Tool call: llm_time({})" in output  # llm ran the call the model made
    assert output.rstrip().endswith("It is late.")
    first, second = scripted
    assert first[-1] == {"role": "user", "content": "What time is it?"}
    call = second[-2]["tool_calls"][0]
    assert call["function"] == {"name": "llm_time", "arguments": {}} and call["id"]
    result = second[-1]
    assert result["role"] == "tool" and result["tool_call_id"] == call["id"]
    assert "utc_time" in json.loads(result["content"])  # llm_time's output, fed back to the model
    logs = json.loads(ok("logs", "--json", "-n", "2"))
    assert logs[-1]["response_json"]["prefix_cache_hit_tokens"] > 0  # the loop's first turn, from the cache


def test_tools_on_a_model_without_a_tool_format_are_a_clean_error(user_dir):  # noqa: F811
    assert_clean_error(run_llm("-m", "paged-smollm2", "-T", "llm_time", "What time is it?"), "tool")


def test_llm_chat_runs_the_tool_loop_each_turn(scripted):
    output = ok("chat", "-m", "scripted", "-T", "llm_time", input="What time is it?\nAnd now?\nquit\n")
    assert output.count("It is late.") == 2
    assert [messages[-1]["role"] for messages in scripted] == ["user", "tool", "user", "tool"]


# -- the same through the server, with the openai client ---------------------------------------

TIME_TOOL = {"type": "function", "function": {"name": "llm_time", "description": "The time", "parameters": {}}}


@pytest.fixture
def client(tmp_path, monkeypatch):
    folder = tmp_path / "scripted"
    folder.mkdir()
    load_scripted_from(folder, monkeypatch)
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    loop = engines.engine_loop("scripted-server", str(folder), lambda: str(folder))
    config = serving_config(PagedOptions(kv_budget="16MB", kv_disk_budget=0, block_size=4))
    running = Running(create_app(ServedModel("scripted", loop, config)))
    yield openai.OpenAI(base_url=running.url + "/v1", api_key="none")
    running.stop()
    loop.stop()


def test_the_server_returns_tool_calls_and_takes_their_results(client):
    question = [{"role": "user", "content": "What time is it?"}]
    reply = client.chat.completions.create(model="scripted", messages=question, tools=[TIME_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "llm_time" and json.loads(call.function.arguments) == {}
    turn = [*question, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"utc_time": "now"}'}]  # fmt: skip
    answer = client.chat.completions.create(model="scripted", messages=turn, tools=[TIME_TOOL])
    assert answer.choices[0].message.content == "It is late." and answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens_details.cached_tokens > 0  # the first turn's blocks


def test_streamed_tool_calls_come_as_openai_streams_them(client):
    stream = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "What time is it?"}], tools=[TIME_TOOL], stream=True
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert content == "" and [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, "llm_time", "{}")]


def test_tool_choice_none_leaves_the_tools_out(client):
    reply = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "What time is it?"}], tools=[TIME_TOOL],
        tool_choice="none",
    )  # fmt: skip
    # The template renders no tools; the script still writes the call, which is then plain text.
    assert reply.choices[0].message.tool_calls is None and "<tool_call>" in reply.choices[0].message.content


@pytest.mark.parametrize(
    "change,words",
    [
        ({"tool_choice": "required"}, ["tool_choice", "auto"]),
        ({"tool_choice": {"type": "function", "function": {"name": "llm_time"}}}, ["tool_choice"]),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, ["tools.0.function.name"]),
        # the scripted model's word-level tokenizer has no decoder llguidance reads
        ({"response_format": {"type": "json_object"}}, ["tokenizer cannot constrain output to a JSON schema"]),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(client, change, words):
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "tools": [TIME_TOOL], **change}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**body)
    for word in words:
        assert word in str(error.value)
