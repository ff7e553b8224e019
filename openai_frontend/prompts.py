"""Prompts into token ids: the model's tokenizer, its chat template and its context length.

The frontend tokenizes every prompt itself and sends `input_ids` to Triton, so it knows each
prompt's length before the request leaves: context-length errors and the default `max_tokens` of a
chat request are decided here, in OpenAI's words.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from openai_frontend.errors import context_length_error, invalid
from openai_frontend.tool_parsers import ToolParser, inline_tools

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only


def valid_text(text: str, param: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"); no tokenizer accepts them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(param, f"{param}: not valid Unicode (lone surrogate)") from None
    return text


class PromptBuilder:
    def __init__(self, model: str, tokenizer: str | None = None, max_model_len: int | None = None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model, trust_remote_code=False)
        config_path = Path(model) / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.max_model_len = max_model_len or config.get("max_position_embeddings", 2048)
        self.vocab_size = max(config.get("vocab_size", 0), len(self.tokenizer))

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """A completion prompt, tokenized as the engine tokenizes text (special tokens added)."""
        return self.tokenizer(valid_text(text, param)).input_ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def check_token_ids(self, token_ids: list[int], param: str) -> list[int]:
        if not all(0 <= t < self.vocab_size for t in token_ids):
            raise invalid(param, f"{param}: token ids must be integers in [0, {self.vocab_size})")
        return token_ids

    @property
    def template_knows_tools(self) -> bool:
        return "tools" in (self.tokenizer.chat_template or "")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                    tools: list[dict] | None = None, tool_parser: ToolParser | None = None) -> tuple[str, list[int]]:
        """The chat template's text and its token ids (the template writes the special tokens).
        Tools go to a template that knows them; for one that does not, `tool_parser` writes them,
        and earlier calls and results, into the messages."""
        if self.tokenizer.chat_template is None:
            raise invalid("messages", "this model has no chat template; use /v1/completions")
        extra = {}
        if self.template_knows_tools:
            extra = {"tools": tools} if tools else {}
        elif tool_parser is not None:
            messages = inline_tools(messages, tools, tool_parser)
        if continue_final_message and (add_generation_prompt or messages[-1]["role"] != "assistant"):
            raise invalid("continue_final_message", "continue_final_message needs a final assistant "
                          "message and add_generation_prompt false")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **extra)
        except Exception as error:  # a template may raise on messages it does not accept
            raise invalid("messages", f"messages: the chat template rejected them: {error}") from None
        return text, self.tokenizer(valid_text(text, "messages"), add_special_tokens=False).input_ids

    def max_tokens_for(self, prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> int:
        """`max_tokens`, or all the room left in the context when it is None; 400 if it won't fit."""
        room = self.max_model_len - prompt_tokens
        if max_tokens is None:
            if room < 1:
                raise context_length_error(self.max_model_len, prompt_tokens, None, prompt_param)
            return room
        if max_tokens > room:
            raise context_length_error(self.max_model_len, prompt_tokens, max_tokens, prompt_param)
        return max_tokens
