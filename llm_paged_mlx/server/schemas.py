"""The request bodies the server accepts: OpenAI's chat completions (with tools) and completions, text only.

Values have JSON's types, as the OpenAPI schema says: true is no integer, "yes"
no boolean, "5" no number. Fields OpenAI defines that would change the answer and
that this server cannot honour are declared, so that a request asking for them is
refused by name instead of silently ignored; other unknown fields are ignored, as
OpenAI clients send fields of newer API versions (and ones such as ``metadata``,
``store`` or ``service_tier``, which change nothing in the answer).
"""

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from ..engine.request import MAX_LOGIT_BIAS, MAX_LOGPROBS


def _integer(value):
    """JSON Schema's integers: 3.0 is one, true is none (for Python, True is 1)."""
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer, not a boolean")
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _boolean(value):
    if not isinstance(value, bool):  # for Python, 0 is False
        raise PydanticCustomError("bool_type", "Input should be a valid boolean")
    return value


def _chooses(value):
    if value not in ("none", "auto"):
        raise PydanticCustomError("unsupported", "only 'auto' and 'none' are supported (the model chooses whether to "
                                  "call a tool; it cannot be made to)")
    return value


def _refused(value):
    if value is not None:  # null is the one value such a field takes
        raise PydanticCustomError("unsupported", "not supported by this server (leave it out, or null)")
    return value


# Before a strict int, or a literal (compared with Python's ==, for which True is 1 and 0 is False): JSON's
# types, as the schema gives them.
AnInteger = BeforeValidator(_integer)
ABoolean = BeforeValidator(_boolean)
Unsupported = Annotated[None, BeforeValidator(_refused)]  # an OpenAI field this server cannot honour


def integer(**bounds):
    """A JSON integer within ``bounds`` (Field's ge, le: inside the validator, where the schema shows them)."""
    return Annotated[int, Field(**bounds), AnInteger]


PositiveInt = integer(ge=1)
TokenIds = Annotated[list[integer(ge=0)], Field(min_length=1)]
StopStrings = Union[Annotated[str, Field(min_length=1)], Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]]
# OpenAI's logit_bias: token ids (JSON's keys are strings) to a bias added to the token's logit.
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
    Field(json_schema_extra={"additionalProperties": False}),  # patternProperties alone would let other keys by
]


class Strict(BaseModel):
    """A part of a request: its values are of the types the schema gives them (an int is also a number)."""

    model_config = ConfigDict(strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text as OpenAI's API gives it, though a model's may not be JSON


class ToolCallIn(Strict):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # an assistant turn's calls
    tool_call_id: Optional[str] = None  # the call a tool message answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionSpec(Strict):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(min_length=1)]
    description: Optional[str] = None
    parameters: Optional[dict] = None


class ToolSpec(Strict):
    """A tool the model may call: a function, as OpenAI's API describes one."""

    type: Literal["function"]
    function: FunctionSpec


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(Strict):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: Optional[str] = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StreamOptions(Strict):
    include_usage: Optional[bool] = False


class SamplingFields(Strict):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[PositiveInt] = None
    temperature: Optional[Annotated[float, Field(ge=0, le=2)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    seed: Optional[integer()] = None
    stop: Optional[StopStrings] = None
    # null is the default for every optional field, as OpenAI's API has it
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[Annotated[Literal[1], AnInteger]] = Field(1, description="Only one choice per request is supported")
    presence_penalty: Optional[Annotated[Literal[0, 0.0], AnInteger]] = Field(
        0, description="Penalties are not supported: 0 only"
    )
    frequency_penalty: Optional[Annotated[Literal[0, 0.0], AnInteger]] = Field(
        0, description="Penalties are not supported: 0 only"
    )
    logit_bias: Optional[LogitBias] = Field(
        None, description=f"Token ids (of the model's tokenizer) to a bias from -{MAX_LOGIT_BIAS} to {MAX_LOGIT_BIAS} "
        "added to their logits before sampling: -100 bans a token, 100 all but forces it"
    )
    user: Optional[str] = None

    def stops(self) -> Optional[list[str]]:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[PositiveInt] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[integer(ge=0, le=MAX_LOGPROBS)] = None
    tools: Optional[list[ToolSpec]] = None
    tool_choice: Optional[Annotated[Literal["none", "auto"], BeforeValidator(_chooses)]] = Field(
        None, description="The model chooses whether to call a tool: 'required' and a named function are not supported"
    )
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat]] = Field(None, discriminator="type")
    modalities: Optional[list[Literal["text"]]] = Field(None, description="Text only")
    audio: Unsupported = Field(None, description="Audio output is not supported")
    functions: Unsupported = Field(None, description="Deprecated by OpenAI, and not supported: use tools")
    function_call: Unsupported = Field(None, description="Deprecated by OpenAI, and not supported: use tool_choice")
    reasoning_effort: Unsupported = Field(None, description="Not supported")
    verbosity: Unsupported = Field(None, description="Not supported")
    web_search_options: Unsupported = Field(None, description="Web search is not supported")

    def json_schema(self) -> Optional[dict]:
        """The JSON schema the answer must fit, if the response format asks for JSON."""
        if isinstance(self.response_format, JsonSchemaFormat):
            return self.response_format.json_schema.schema_
        if isinstance(self.response_format, JsonObjectFormat):
            return {"type": "object"}
        return None


class CompletionRequest(SamplingFields):
    prompt: Union[
        str,
        TokenIds,
        Annotated[list[str], Field(min_length=1, max_length=1)],
        Annotated[list[TokenIds], Field(min_length=1, max_length=1)],
    ]
    logprobs: Optional[integer(ge=0, le=5)] = None
    echo: Optional[Annotated[Literal[False], ABoolean]] = Field(False, description="Echoing the prompt is not supported")
    best_of: Optional[Annotated[Literal[1], AnInteger]] = Field(
        1, description="Only one candidate per request is supported"
    )
    suffix: Optional[Literal[""]] = Field(None, description="Suffixes are not supported")


# -- responses ----------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]  # null when the answer is tool calls alone
    tool_calls: Optional[list[ToolCallOut]] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: Optional[CompletionLogprobs] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
