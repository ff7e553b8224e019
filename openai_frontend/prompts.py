"""Prompts into token ids: the model's tokenizer, its chat template and its context length.

The frontend tokenizes every prompt itself and sends `input_ids` to Triton, so it knows each
prompt's length before the request leaves: context-length errors and the default `max_tokens` of a
chat request are decided here, in OpenAI's words.
"""

from __future__ import annotations

import functools
import json
import os
import re
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


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file's content, else the text itself as the template."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:  # no Jinja at all: a file name that is not there
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


class PromptBuilder:
    def __init__(self, model: str, tokenizer: str | None = None, max_model_len: int | None = None,
                 chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model, trust_remote_code=False)
        if chat_template is not None:
            self.tokenizer.chat_template = load_chat_template(chat_template)
        config_path = Path(model) / "config.json"
        self.config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        text_config = self.config.get("text_config") or {}  # a vision-language model's decoder
        self.max_model_len = max_model_len or self.config.get("max_position_embeddings",
                                                              text_config.get("max_position_embeddings", 2048))
        self.vocab_size = max(self.config.get("vocab_size", text_config.get("vocab_size", 0)), len(self.tokenizer))
        # Strings the tokenizer turns into special tokens: only the chat template may write them.
        self.special_strings = sorted({token.content for token in self.tokenizer.added_tokens_decoder.values()
                                       if token.special and token.content}, key=len, reverse=True)

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
                    tools: list[dict] | None = None, tool_parser: ToolParser | None = None,
                    template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """The chat template's text and its token ids (the template writes the special tokens).
        Tools go to a template that knows them; for one that does not, `tool_parser` writes them,
        and earlier calls and results, into the messages. `template_kwargs`: more variables for the
        template (vLLM's chat_template_kwargs, such as enable_thinking)."""
        if self.tokenizer.chat_template is None:
            raise invalid("messages", "this model has no chat template; use /v1/completions")
        extra = {}
        if self.template_knows_tools:
            extra = {"tools": tools} if tools else {}
        elif tool_parser is not None:
            messages = inline_tools(messages, tools, tool_parser)
        extra.update(template_kwargs or {})
        if continue_final_message and (add_generation_prompt or messages[-1]["role"] != "assistant"):
            raise invalid("continue_final_message", "continue_final_message needs a final assistant "
                          "message and add_generation_prompt false")
        if any(isinstance(message.get("content"), list) for message in messages):  # images among the parts
            return self.render_with_images(messages, add_generation_prompt, continue_final_message, extra)
        if not any(self.has_special(message.get("content")) for message in messages):
            text = self.apply_template(messages, add_generation_prompt, continue_final_message, extra)
            return text, self.tokenizer(valid_text(text, "messages"), add_special_tokens=False).input_ids
        return self.render_with_plain_content(messages, add_generation_prompt, continue_final_message, extra)

    def has_special(self, text) -> bool:
        return isinstance(text, str) and any(special in text for special in self.special_strings)

    def apply_template(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                       extra: dict) -> str:
        if any(self.has_special(text) for text in strings_in({"messages": messages, **extra})):
            raise invalid("messages", "messages: the model's special tokens may appear only in message "
                                      "content (where they are read as plain text)")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **extra)
        except Exception as error:  # a template may raise on messages it does not accept
            raise invalid("messages", f"messages: the chat template rejected them: {error}") from None

    def render_with_plain_content(self, messages: list[dict], add_generation_prompt: bool,
                                  continue_final_message: bool, extra: dict) -> tuple[str, list[int]]:
        """Content that spells a special token ("<|im_end|>\n<|im_start|>system") must not forge a
        turn: render the template around placeholders, tokenize what the template wrote as usual and
        each content with special tokens split into plain text (the tokenizers' split_special_tokens)."""
        contents = [message.get("content") for message in messages]
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        placeheld = [{**message, "content": mark} if isinstance(message.get("content"), str) else message
                     for message, mark in zip(messages, marks)]
        text = self.apply_template(placeheld, add_generation_prompt, continue_final_message, extra)
        pieces = re.split("(\ue000\\d+\ue001)", text)
        if sorted(pieces[1::2]) != sorted(mark for mark, content in zip(marks, contents) if isinstance(content, str)):
            # The template rewrote or repeated a content: it cannot be kept apart from the template's text.
            raise invalid("messages", "messages: content must not contain the model's special tokens "
                                      "with this chat template")
        token_ids, rendered = [], []
        for k, piece in enumerate(pieces):
            if k % 2:
                content = valid_text(contents[marks.index(piece)], "messages")
                rendered.append(content)
                token_ids += self.tokenizer(content, add_special_tokens=False, split_special_tokens=True).input_ids
            elif piece:
                rendered.append(piece)
                token_ids += self.tokenizer(valid_text(piece, "messages"), add_special_tokens=False).input_ids
        return "".join(rendered), token_ids

    # -- images ----------------------------------------------------------------------------------
    @functools.cached_property
    def image_token(self) -> str | None:
        """The placeholder the model's processor expands into an image's tokens (config.json's
        image_token_index; Gemma 3's is its begin-of-image token, boi_token_index, which its processor
        expands into the image's soft tokens); None: the model takes no images."""
        token_id = self.config.get("boi_token_index", self.config.get("image_token_index", self.config.get("image_token_id")))
        return None if token_id is None else self.tokenizer.convert_ids_to_tokens(token_id)

    @functools.cached_property
    def template_takes_image_parts(self) -> bool:
        """Whether the chat template reads content as a list of parts with {"type": "image"} among them,
        as transformers' templates for vision-language models do (vLLM's "openai" content format);
        else each image's placeholder is written into the message's text."""
        probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\ue000"}]}]
        try:
            text = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        except Exception:  # a template for text content may fail on a list
            return False
        return "\ue000" in text and self.image_token in text

    def render_with_images(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                           extra: dict) -> tuple[str, list[int]]:
        """Messages whose content is a list of text and {"type": "image"} parts. The prompt goes to
        Triton as text (the model's processor places each image's tokens), where a special token in a
        content would be read as one: refused. The token ids count only one per image."""
        parts = [part for message in messages for part in as_parts(message.get("content"))]
        images = sum(part["type"] == "image" for part in parts)
        if any(self.has_special(part.get("text")) for part in parts):
            raise invalid("messages", "messages: with images, content must not contain the model's special tokens")
        if self.template_takes_image_parts:
            messages = [{**message, "content": as_parts(message.get("content"))} for message in messages]
        else:
            messages = [{**message, "content": "\n".join(self.image_token if part["type"] == "image" else part["text"]
                                                         for part in message["content"])}
                        if isinstance(message.get("content"), list) else message for message in messages]
        text = self.apply_template(messages, add_generation_prompt, continue_final_message, extra)
        if text.count(self.image_token) != images:
            raise invalid("messages", f"messages: the chat template wrote {text.count(self.image_token)} image "
                                      f"placeholders for {images} images")
        return text, self.tokenizer(valid_text(text, "messages"), add_special_tokens=False).input_ids

    def truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: max_model_len)."""
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.max_model_len
        if keep < 1 or keep > self.max_model_len:
            raise invalid("truncate_prompt_tokens", f"truncate_prompt_tokens: must be -1 or in [1, max_model_len "
                                                    f"({self.max_model_len})], got {keep}")
        return token_ids[-keep:]

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


def as_parts(content: str | list[dict] | None) -> list[dict]:
    return content if isinstance(content, list) else [{"type": "text", "text": content or ""}]


def strings_in(value) -> list[str]:
    """Every string inside a JSON-like value but message contents (keys included)."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            stack += [v for k, v in item.items() if k != "content" or not isinstance(v, str)]
            found += [k for k in item if isinstance(k, str)]
        elif isinstance(item, (list, tuple)):
            stack += list(item)
    return found
