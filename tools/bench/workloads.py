"""Deterministic benchmark workloads: token-id prompts and output lengths, the same for every engine.

- `fixed`: prompts of input_len +/- 12.5 % tokens, output_len tokens each (issue #8's 128/128).
- `shared-prefix`: one ~1,000-token system prompt shared by every request, plus a short question.
- `mixed`: lengths drawn from a ShareGPT-like log-normal distribution (long tail of long prompts).
- `long`: prompts of exactly input_len tokens (default 2,000; 8,000 fits SmolLM2's 8,192 positions),
  output_len each: prefill dominates, so time to first token is the figure to watch.
Prompts are token ids so every engine sees exactly the same lengths.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there been one all we their has would when if so "
         "what can no said who more about up its out into them then time than some only could new "
         "like other these two may first any do now such after most made over also did many before "
         "must through back years where much your way well down should because each just those "
         "people how too little state good very make world still own see men work long here get both "
         "between life being under never day same another know while last might us great old year "
         "off come since against go came right used take three kernel cache token model batch").split()

WORKLOADS = ("fixed", "shared-prefix", "mixed", "long")
# The flags --input-len and --num-prompts default per workload (a long prompt costs 16 short ones).
DEFAULT_INPUT_LEN = {"long": 2000}
DEFAULT_NUM_PROMPTS = {"long": 8}


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_input_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def text_tokens(tokenizer, rng: random.Random, length: int) -> list[int]:
    text = " ".join(rng.choice(WORDS) for _ in range(length * 2))
    return tokenizer(text, add_special_tokens=False).input_ids[:length]


def make_workload(name: str, tokenizer, num_prompts: int, seed: int = 0, input_len: int = 128,
                  output_len: int = 128) -> Workload:
    rng = random.Random(seed)
    if name == "fixed":
        spread = input_len // 8
        prompts = [text_tokens(tokenizer, rng, rng.randint(input_len - spread, input_len + spread))
                   for _ in range(num_prompts)]
        return Workload(name, prompts, [output_len] * num_prompts)
    if name == "shared-prefix":
        system = text_tokens(tokenizer, rng, 1000)
        prompts = [system + text_tokens(tokenizer, rng, rng.randint(32, 64)) for _ in range(num_prompts)]
        return Workload(name, prompts, [output_len] * num_prompts)
    if name == "mixed":
        prompts, outputs = [], []
        for _ in range(num_prompts):
            prompt_len = int(min(1024, max(16, math.exp(rng.gauss(math.log(200), 0.8)))))
            prompts.append(text_tokens(tokenizer, rng, prompt_len))
            outputs.append(int(min(512, max(8, math.exp(rng.gauss(math.log(150), 0.7))))))
        return Workload(name, prompts, outputs)
    if name == "long":
        return Workload(name, [text_tokens(tokenizer, rng, input_len) for _ in range(num_prompts)],
                        [output_len] * num_prompts)
    raise ValueError(f"workload: one of {', '.join(WORKLOADS)}, got {name!r}")


def warm_up_prompts(workload: Workload) -> list[list[int]]:
    """Two prompts of the workload's lengths that share no prefix with its prompts (reversed), so that
    warming up leaves nothing in the prefix cache for the measured run to find."""
    return [prompt[::-1] for prompt in workload.prompts[:2]]


def resolved_model(args) -> str:
    """The model folder of `--model` (default: the prepared SmolLM2), whose tokenizer makes the prompts."""
    from backend.model_paths import resolve_model_path
    from tools.prepare_model import prepare_model
    return resolve_model_path(args.model) if args.model else str(prepare_model())
