"""The request bodies the server accepts: OpenAI's chat completions (with tools) and completions, text only.

Fields OpenAI defines that this server cannot honour are declared, so that a
request asking for them is refused by name instead of silently ignored; other
unknown fields are ignored, as OpenAI clients send fields of newer API versions.
"""

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from ..engine.request import MAX_LOGPROBS



def _not_a_bool(value):
    if isinstance(value, bool):  # JSON's true is no integer (1.0 is: JSON Schema says so)
        raise PydanticCustomError("int_type", "Input should be a valid integer, not a boolean")
    return value


PositiveInt = Annotated[int, Field(ge=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0), BeforeValidator(_not_a_bool)]], Field(min_length=1)]
StopStrings = Union[Annotated[str, Field(min_length=1)], Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI's API gives it


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
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


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(min_length=1)]
    description: Optional[str] = None
    parameters: Optional[dict] = None


class ToolSpec(BaseModel):
    """A tool the model may call: a function, as OpenAI's API describes one."""

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class TextFormat(BaseModel):
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: Optional[str] = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None


class JsonSchemaFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StreamOptions(BaseModel):
    include_usage: Optional[bool] = False


class SamplingFields(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[PositiveInt] = None
    temperature: Optional[Annotated[float, Field(ge=0, le=2)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    seed: Optional[int] = None
    stop: Optional[StopStrings] = None
    # null is the default for every optional field, as OpenAI's API has it
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[Literal[1]] = Field(1, description="Only one choice per request is supported")
    presence_penalty: Optional[Literal[0, 0.0]] = Field(0, description="Penalties are not supported: 0 only")
    frequency_penalty: Optional[Literal[0, 0.0]] = Field(0, description="Penalties are not supported: 0 only")
    user: Optional[str] = None

    def stops(self) -> Optional[list[str]]:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[PositiveInt] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    tools: Optional[list[ToolSpec]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat]] = Field(None, discriminator="type")

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
    logprobs: Optional[Annotated[int, Field(ge=0, le=5)]] = None
    echo: Optional[Literal[False]] = Field(False, description="Echoing the prompt is not supported")
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
