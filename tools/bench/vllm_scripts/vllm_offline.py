"""vLLM's LLM on the bench's workload, in the vLLM venv:

    python vllm_offline.py SPEC.json RESULT.json

SPEC holds model, dtype, prompts (token ids), output_lens and warm_up (prompts); RESULT gets the
measured seconds, the start-up seconds, the number of output tokens and one record per request
(prompt and output tokens, seconds to the first token and to the last, from when it was added).
Every request is added at once and the engine stepped as `LLM.generate` does, but with outputs
streamed as deltas, so that each request's first token is seen when it comes.
"""

import json
import sys
import time


def main(spec_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    with open(spec_path, encoding="utf-8") as file:
        spec = json.load(file)
    start = time.perf_counter()
    llm = LLM(spec["model"], dtype=spec["dtype"], seed=0)
    startup = time.perf_counter() - start
    llm.generate([{"prompt_token_ids": p} for p in spec["warm_up"]], SamplingParams(max_tokens=4))
    engine = llm.llm_engine
    added, first, records = {}, {}, {}
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(zip(spec["prompts"], spec["output_lens"])):
        added[str(i)] = time.perf_counter()
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True,
                                          output_kind=RequestOutputKind.DELTA))
    counts = dict.fromkeys(added, 0)
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            new_tokens = len(output.outputs[0].token_ids)
            if new_tokens and output.request_id not in first:
                first[output.request_id] = now
            counts[output.request_id] += new_tokens
            if output.finished:
                records[output.request_id] = {"input_tokens": len(spec["prompts"][int(output.request_id)]),
                                              "output_tokens": counts[output.request_id],
                                              "ttft": first[output.request_id] - added[output.request_id],
                                              "e2e": now - added[output.request_id]}
    elapsed = time.perf_counter() - start
    with open(result_path, "w", encoding="utf-8") as file:
        json.dump({"seconds": elapsed, "startup_s": startup, "output_tokens": sum(counts.values()),
                   "records": [records[i] for i in sorted(records, key=int)]}, file)


if __name__ == "__main__":  # vLLM's worker processes import this file again: only the parent runs
    main(sys.argv[1], sys.argv[2])
