"""Pydantic schemas of the OpenAI API subset we serve: requests (with vLLM's sampling extras) and the
non-streaming responses. Unknown request fields are accepted and ignored, as OpenAI clients expect;
known ones are typed strictly, as OpenAI types them ("2" is not a number, true is not 1)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Bias = Annotated[float, Field(ge=-100, le=100)]


class Request(BaseModel):
    # Infinity and NaN parse as JSON in Python; no sampling knob can take them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(Request):
    include_usage: bool = False


class JsonSchemaFormat(Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Request):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingRequest(Request):
    """Fields shared by completions and chat: OpenAI's sampling knobs plus vLLM's extras."""
    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's range
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    logit_bias: dict[str, Bias] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    cache_salt: str | None = Field(None, min_length=1, description="prefix-cache hits only between requests "
                                                                   "with the same salt (tenant isolation)")
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream_interval: int | None = Field(None, ge=1, lt=2**31,
                                        description="tokens per streamed chunk (the first at once); at least "
                                                    "the server's --stream-interval")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[TokenId] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="keep the prompt's last N tokens "
                                                                        "(-1: max_model_len)")
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1, description="scheduling priority, lower first "
                                                                   "(needs --scheduling-policy priority)")


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=0, description="null: all the room left in the context; 0 only "
                                                         "with echo (the prompt and its logprobs alone)")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's bound for completions
    best_of: int | None = Field(None, ge=1, le=128, description="samples to draw per prompt; the n with the "
                                                                "highest cumulative logprob are returned")
    # vLLM's beam search extras (non-streamed): the n best of best_of (or n) beams, best first
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False


class ImageURL(Request):
    url: str  # a data: URL, or http(s): and file: where the operator allows them (openai_frontend/media.py)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sizes images


class ContentPart(Request):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None  # type "image_url"


class FunctionCall(Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: which call this answers
    reasoning: str | None = None  # assistant messages: their thinking, given back (vLLM's field)
    reasoning_content: str | None = None  # the same, by its older name


class FunctionDefinition(Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; none: the function takes no arguments
    strict: bool | None = None


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(Request):
    name: str


class NamedToolChoice(Request):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the chat template (enable_thinking)


class EmbeddingRequest(Request):
    model: str
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


# -- responses -----------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details

    @model_serializer(mode="wrap")
    def _without_absent_details(self, handler):
        """prompt_tokens_details appears only when the server was asked for it (as in vLLM)."""
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None (and top_logprobs None) for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = None  # with --reasoning-parser: the thinking before the answer (vLLM's field)
    reasoning_content: str | None = None  # the same, by its older name
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tritonllm"
    root: str | None = None  # a LoRA adapter: its folder
    parent: str | None = None  # a LoRA adapter: the base model's id
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
