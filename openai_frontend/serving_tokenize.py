"""POST /tokenize and /detokenize in vLLM's shapes: a completion prompt or chat messages (rendered by
the chat template as /v1/chat/completions renders them) into token ids, and token ids into text.
The frontend's own tokenizer answers; Triton is not asked."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from openai_frontend.errors import invalid
from openai_frontend.prompts import valid_text
from openai_frontend.schemas import ChatMessage, Request, TokenId, Tool
from openai_frontend.serving_chat import template_messages


class TokenizeRequest(Request):
    """vLLM's two forms: `prompt` (a completion prompt) or `messages` (a chat)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def one_form(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


def check_model(frontend, model: str | None) -> None:
    if model is not None:
        frontend.check_llm_model(model)


def tokenize(frontend, body: TokenizeRequest) -> TokenizeResponse:
    check_model(frontend, body.model)
    prompts = frontend.prompts
    if body.prompt is not None:
        if body.add_special_tokens is False:
            ids = prompts.tokenizer(valid_text(body.prompt, "prompt"), add_special_tokens=False).input_ids
        else:
            ids = prompts.encode(body.prompt)
    else:
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
        messages, images = template_messages(body.messages)
        if images:  # their tokens are the model processor's to count, in Triton
            raise invalid(images[0].param, f"{images[0].param}: images are not tokenized here")
        text, ids = prompts.render_chat(messages, body.add_generation_prompt, body.continue_final_message,
                                        tools or None)
        if body.add_special_tokens:  # the rendered text with the tokenizer's own (a BOS for some), as vLLM
            ids = prompts.tokenizer(text, add_special_tokens=True).input_ids
    strings = prompts.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=prompts.max_model_len, tokens=ids, token_strs=strings)


def detokenize(frontend, body: DetokenizeRequest) -> DetokenizeResponse:
    check_model(frontend, body.model)
    if not body.tokens:
        raise invalid("tokens", "tokens: must not be empty")
    return DetokenizeResponse(prompt=frontend.prompts.decode(frontend.prompts.check_token_ids(body.tokens, "tokens")))
