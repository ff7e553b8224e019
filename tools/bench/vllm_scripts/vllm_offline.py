"""vLLM's LLM.generate on the bench's workload, in the vLLM venv:

    python vllm_offline.py SPEC.json RESULT.json

SPEC holds model, dtype, prompts (token ids), output_lens and warm_up (prompts); RESULT gets the
measured seconds, the start-up seconds and the number of output tokens.
"""

import json
import sys
import time


def main(spec_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(spec_path) as file:
        spec = json.load(file)
    start = time.perf_counter()
    llm = LLM(spec["model"], dtype=spec["dtype"], seed=0)
    startup = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["output_lens"]]
    llm.generate([{"prompt_token_ids": p} for p in spec["warm_up"]], [SamplingParams(max_tokens=4)] * 2)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    with open(result_path, "w") as file:
        json.dump({"seconds": elapsed, "startup_s": startup,
                   "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}, file)


if __name__ == "__main__":  # vLLM's worker processes import this file again: only the parent runs
    main(sys.argv[1], sys.argv[2])
