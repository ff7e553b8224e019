"""vLLM's LLM on tools/bench_images.py's image+text workloads, in the vLLM venv:

    python vllm_images.py SPEC.json RESULT.json

SPEC holds model, dtype, max_tokens and workloads: each a name, its prompts (text, one <image> each),
their images (PNG paths) and warm-up prompts and images of the same size. RESULT gets, per workload, the
measured seconds, one record per request (prompt and output tokens, seconds to the first token and to
the last, from just before it was added), its greedy token ids, and the seconds spent in the model's
`embed_multimodal` (the vision tower and projector) over the images it encoded. Every request is added
at once and the engine stepped as `LLM.generate` does, outputs streamed as deltas, as vllm_offline.py does.
"""

import importlib
import json
import sys
import time


def time_encoder(model):
    """Wraps the model's `embed_multimodal` (run in vLLM's worker process) with a clock: seconds and images."""
    encode = model.embed_multimodal
    totals = model.bench_encoder_totals = {"seconds": 0.0, "images": 0}

    def timed(**kwargs):
        start = time.perf_counter()
        features = encode(**kwargs)
        totals["seconds"] += time.perf_counter() - start
        totals["images"] += len(features)
        return features

    model.embed_multimodal = timed


def encoder_totals(model):
    """The clock's seconds and images since the last call, which starts it again from zero."""
    totals = dict(model.bench_encoder_totals)
    model.bench_encoder_totals.update(seconds=0.0, images=0)
    return totals


def run_workload(llm, workload, max_tokens, clock):
    from vllm import SamplingParams
    from vllm.multimodal.utils import fetch_image
    from vllm.sampling_params import RequestOutputKind

    def request(text, path):
        return {"prompt": text, "multi_modal_data": {"image": fetch_image("file://" + path)}}

    llm.generate([request(t, p) for t, p in zip(workload["warm_up"], workload["warm_up_images"])],
                 SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.apply_model(clock.encoder_totals)
    requests = [request(t, p) for t, p in zip(workload["prompts"], workload["images"])]  # images read before the timed run
    engine = llm.llm_engine
    added, first, tokens, records = {}, {}, {}, {}
    start = time.perf_counter()
    for i, prompt in enumerate(requests):
        added[str(i)] = time.perf_counter()
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                          output_kind=RequestOutputKind.DELTA))
    prompt_lens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            new_tokens = list(output.outputs[0].token_ids)
            if new_tokens and output.request_id not in first:
                first[output.request_id] = now
            tokens.setdefault(output.request_id, []).extend(new_tokens)
            if output.prompt_token_ids:
                prompt_lens[output.request_id] = len(output.prompt_token_ids)
            if output.finished:
                records[output.request_id] = {"input_tokens": prompt_lens.get(output.request_id, 0),
                                              "output_tokens": len(tokens[output.request_id]),
                                              "ttft": first[output.request_id] - added[output.request_id],
                                              "e2e": now - added[output.request_id]}
    elapsed = time.perf_counter() - start
    order = sorted(records, key=int)
    return {"seconds": elapsed, "records": [records[i] for i in order], "tokens": [tokens[i] for i in order],
            "encoder": llm.apply_model(clock.encoder_totals)[0]}


def main(spec_path: str, result_path: str) -> None:
    from vllm import LLM

    # apply_model pickles the clock's functions (the caller sets VLLM_ALLOW_INSECURE_SERIALIZATION=1) by
    # reference: under this file's module name, which vLLM's processes import (they share its sys.path),
    # not __main__'s, which they do not share.
    clock = importlib.import_module("vllm_images")

    with open(spec_path, encoding="utf-8") as file:
        spec = json.load(file)
    start = time.perf_counter()
    llm = LLM(spec["model"], dtype=spec["dtype"], seed=0, limit_mm_per_prompt={"image": 1})
    startup = time.perf_counter() - start
    llm.apply_model(clock.time_encoder)
    results = {w["name"]: run_workload(llm, w, spec["max_tokens"], clock) for w in spec["workloads"]}
    with open(result_path, "w", encoding="utf-8") as file:
        json.dump({"startup_s": startup, "workloads": results}, file)


if __name__ == "__main__":  # vLLM's worker processes import this file again: only the parent runs
    main(sys.argv[1], sys.argv[2])
