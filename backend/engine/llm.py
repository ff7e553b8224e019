"""LLM: the offline API, shaped like vLLM's (`generate`, `chat`, `beam_search`, `get_metrics`)."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from backend.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, candidates_of, check_fits, step_params
from backend.config import LARGE_STEP_TOKENS, EngineConfig
from backend.engine.chat_images import chat_images
from backend.engine.engine import LLMEngine
from backend.errors import EngineError
from backend.lora import LoRARequest
from backend.outputs import RequestOutput
from backend.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict  # text, token ids, or vLLM's dict (with multi_modal_data)


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is None:  # the default model: fetched and converted on first use
            from tools.prepare_model import prepare_model

            model = str(prepare_model())
        config = EngineConfig.from_dict({"model": model, **kwargs})
        if config.max_num_batched_tokens is None and config.enable_chunked_prefill:
            config.max_num_batched_tokens = LARGE_STEP_TOKENS
        self.llm_engine = LLMEngine(config)
        self._request_counter = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults (vLLM's; generation_config=vllm: none)."""
        return SamplingParams(**self.llm_engine.generation_defaults)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in the prompts' order.
        lora_request: one adapter for every prompt, or one (or None) per prompt. `priority` (one
        per prompt, lower first) needs scheduling_policy="priority", as in vLLM."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params: give one, or one per prompt")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise EngineError("lora_request", "give one, or one per prompt")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise EngineError("priority", "give one per prompt")
        order: dict[str, int] = {}
        for prompt, params, lora, rank in zip(prompts, sampling_params, lora_request, priority):
            params = SamplingParams(**{**params.__dict__, "output_kind": RequestOutputKind.FINAL_ONLY})
            request_id = str(next(self._request_counter))
            order[request_id] = len(order)
            self.llm_engine.add_request(request_id, prompt, params, lora_request=lora, priority=rank)
        return self._run(order, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, add_generation_prompt: bool = True,
             chat_template: str | None = None, use_tqdm: bool = False,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template, then generate. Content may
        hold OpenAI-style image_url parts (data URLs) for a vision-language model: the template writes
        each image's placeholder and the model's processor expands it (`chat_images.py`)."""
        conversations: list = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts, requests = [], []
        for conversation in conversations:
            conversation, images = chat_images(conversation)
            prompt = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                                   add_generation_prompt=add_generation_prompt)
            prompts.append(prompt)
            # The template already holds the special tokens; don't let the tokenizer add a BOS twice.
            requests.append({"prompt": prompt, "multi_modal_data": {"image": images}} if images
                            else tokenizer(prompt, add_special_tokens=False).input_ids)
        outputs = self.generate(requests, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for output, prompt in zip(outputs, prompts):
            output.prompt = prompt
        return outputs

    def beam_search(self, prompts: Prompt | dict | Sequence[Prompt | dict], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's `beam_width` best hypotheses, best first, scored as
        transformers' `generate(num_beams=...)` scores them (backend/engine/beam_search.py). All prompts'
        beams run in the same engine steps, one one-token request per beam per step."""
        one = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        items: list = [prompts] if one else list(prompts)
        engine = self.llm_engine
        searches = []
        for item in items:
            # vLLM's TextPrompt / TokensPrompt dicts, or a text, or token ids
            if isinstance(item, dict) and item.get("multi_modal_data") is not None:
                raise EngineError("multi_modal_data", "beam search takes text prompts only")
            prompt: str | list[int] = item.get("prompt_token_ids", item.get("prompt")) if isinstance(item, dict) else item
            _, prompt_ids = engine.tokenize(prompt)
            check_fits(len(prompt_ids), params, engine.max_model_len)
            searches.append(BeamSearch(prompt_ids, params, engine.eos_token_ids))
        while not all(search.done for search in searches):
            order: dict[str, int] = {}
            for search in searches:
                if not search.done:
                    for tokens in search.inputs():
                        request_id = f"beam-{next(self._request_counter)}"
                        order[request_id] = len(order)
                        engine.add_request(request_id, tokens, step_params(search), lora_request=lora_request)
            outputs = iter(self._run(order, use_tqdm=False))
            for search in searches:
                if not search.done:
                    search.advance([candidates_of(next(outputs)) for _ in search.running])
        return [search.output(engine.tokenizer, lora_request) for search in searches]

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(order), desc="generate", unit="req")
        try:
            while any(r is None for r in results):
                for output in self.llm_engine.step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        if bar:
                            bar.update(1)
        except BaseException:
            for request_id in order:
                self.llm_engine.abort_request(request_id)
            raise
        finally:
            if bar:
                bar.close()
        return results

    def get_metrics(self):
        return self.llm_engine.get_metrics()

    def shutdown(self) -> None:
        """Stop tensor/pipeline-parallel worker processes now (they also stop at interpreter exit)."""
        self.llm_engine.shutdown()
