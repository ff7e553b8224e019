"""Incremental detokenization and stop strings.

Each step decodes two short windows of token ids, the text already emitted from `prefix_offset` and
that plus the new tokens, and emits the difference. Decoding a window rather than single tokens keeps
byte-level BPE spaces and SentencePiece word starts right; holding back text that ends in U+FFFD keeps
a multibyte character split across tokens from being emitted half-way. Streamed deltas therefore
concatenate exactly to the final text.
"""

from __future__ import annotations

from backend.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token (vLLM uses the same 5).
INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self.read_offset = len(self.token_ids)
        self.prefix_offset = 0
        self.output_text = ""
        stop = params.stop or []
        self.stop_buffer_length = 0 if params.include_stop_str_in_output or not stop else max(map(len, stop)) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def update(self, new_token_ids: list[int], check_stop: bool) -> str | None:
        """Append tokens and their text; return the stop string that matched, if any (the text is
        then truncated at it)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # wait for the rest of a multibyte character
        previous_length = len(self.output_text)
        self.output_text += new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        if check_stop and self.params.stop:
            return self._truncate_at_stop(previous_length)
        return None

    def _truncate_at_stop(self, previous_length: int) -> str | None:
        for stop in self.params.stop:
            # A match may begin in earlier text and end in the new text.
            start = self.output_text.find(stop, max(0, previous_length - len(stop) + 1))
            if start != -1:
                end = start + len(stop) if self.params.include_stop_str_in_output else start
                self.output_text = self.output_text[:end]
                return stop
        return None

    def emittable_text(self, finished: bool) -> str:
        """Text safe to show: all of it once finished, else without a possible stop-string prefix."""
        if finished or not self.stop_buffer_length:
            return self.output_text
        return self.output_text[:max(0, len(self.output_text) - self.stop_buffer_length)]

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
