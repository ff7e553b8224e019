"""Triton's embeddings model: texts in, L2-normalised sentence embeddings out.

It computes what sentence-transformers computes for all-MiniLM-L6-v2 (Transformer -> mean pooling
over the attention mask -> Normalize), with plain transformers and torch, and never touches the
Hugging Face hub. Triton's dynamic batcher hands several requests to `execute` at once; their texts
(or token-id lists, `input_ids` padded with -1, taken as given like vLLM's token prompts) go through
the model ENCODE_BATCH at a time, and a request cancelled meanwhile (its client left) is dropped
between batches.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are local; never reach for the hub

import numpy as np
import torch
import torch.nn.functional as F
import triton_python_backend_utils as pb_utils
from transformers import AutoModel, AutoTokenizer

ENCODE_BATCH = 32  # texts per forward pass; cancellations are noticed between passes
INVALID = "[code=invalid_parameter param=input]"  # backend/errors.py's wire tag, for the frontend


def model_folder(configured: str) -> Path:
    if configured:
        return Path(configured).expanduser()
    try:
        from backend.model_paths import EMBEDDINGS_MODEL_FILES, default_embeddings_dir, is_prepared
    except ImportError as error:  # the stub runs an isolated Python: PYTHONPATH does not count
        raise ImportError("tritonllm is not importable by Triton's Python stub; install it into the "
                          "Python that runs tritonserver (pip install -e .), or set the model's "
                          "`model` parameter to a sentence-transformers folder") from error
    folder = default_embeddings_dir()
    if not is_prepared(folder, EMBEDDINGS_MODEL_FILES):  # fetched by `tritonllm serve`, never while loading
        raise ValueError(f"model: the embeddings model is not prepared in {folder} "
                         "(run `python -m tools.prepare_embeddings`)")
    return folder


class SentenceEncoder:
    """all-MiniLM-L6-v2 as sentence-transformers runs it: truncate, encode, mean-pool, normalise."""

    def __init__(self, folder: Path, device: str) -> None:
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        # safetensors only: a pickled checkpoint (pytorch_model.bin) could run code when loaded.
        self.model = AutoModel.from_pretrained(folder, dtype=torch.float32, use_safetensors=True,
                                               trust_remote_code=False).to(device).eval()
        config = folder / "sentence_bert_config.json"
        limit = json.loads(config.read_text(encoding="utf-8")).get("max_seq_length") if config.is_file() else None
        self.max_seq_length = limit or self.tokenizer.model_max_length

    @torch.inference_mode()
    def encode(self, items: list[str | list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Texts (truncated, as sentence-transformers does), or token ids of this tokenizer, taken as
        given: a client sending `tokenizer(text).input_ids` already holds [CLS] ... [SEP], and ids
        without them are encoded without them, as vLLM encodes a token prompt."""
        texts = [item for item in items if isinstance(item, str)]
        tokenized = iter(self.tokenizer(texts, truncation=True, max_length=self.max_seq_length).input_ids
                         if texts else [])
        ids = [next(tokenized) if isinstance(item, str) else item for item in items]
        batch = self.tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(self.device)
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        embeddings = F.normalize(pooled, p=2, dim=1)
        return embeddings.cpu().numpy(), batch["attention_mask"].sum(dim=1).cpu().numpy()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        configured = model_config.get("parameters", {}).get("model", {}).get("string_value", "")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.encoder = SentenceEncoder(model_folder(configured), device)

    def execute(self, requests: list) -> list:
        errors: dict[int, object] = {}  # request index -> its TritonError
        items: list[tuple[int, str | list[int]]] = []  # (request index, text or token ids)
        for r, request in enumerate(requests):
            try:
                items += [(r, item) for item in self.read(request)]
            except ValueError as error:
                errors[r] = pb_utils.TritonError(f"{error} {INVALID}", pb_utils.TritonError.INVALID_ARG)
        vectors: dict[int, list] = {r: [] for r in range(len(requests))}
        counts: dict[int, list] = {r: [] for r in range(len(requests))}
        for start in range(0, len(items), ENCODE_BATCH):
            chunk = items[start:start + ENCODE_BATCH]
            for r in {r for r, _ in chunk if r not in errors}:
                if requests[r].is_cancelled():
                    errors[r] = pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
            chunk = [(r, item) for r, item in chunk if r not in errors]
            if not chunk:
                continue
            try:
                embeddings, num_tokens = self.encoder.encode([item for _, item in chunk])
            except Exception as error:  # one failed batch answers every request in it
                for r, _ in chunk:
                    errors[r] = pb_utils.TritonError(f"embedding failed: {error}", pb_utils.TritonError.INTERNAL)
                continue
            for (r, _), vector, count in zip(chunk, embeddings, num_tokens):
                vectors[r].append(vector)
                counts[r].append(count)
        responses = []
        for r in range(len(requests)):
            if r in errors:
                responses.append(pb_utils.InferenceResponse(error=errors[r]))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("embedding", np.stack(vectors[r]).astype(np.float32)),
                pb_utils.Tensor("num_tokens", np.array(counts[r], np.int32).reshape(-1, 1)),
            ]))
        return responses

    def read(self, request) -> list[str | list[int]]:
        """A request's texts, or its token-id lists (rows of `input_ids`, -1 padding dropped)."""
        text = pb_utils.get_input_tensor_by_name(request, "text")
        if text is not None:
            return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)
                    for v in text.as_numpy().reshape(-1)]
        input_ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if input_ids is None:
            raise ValueError("input: give `text` or `input_ids`")
        vocab_size = len(self.encoder.tokenizer)
        rows = [[int(t) for t in row if t >= 0] for row in input_ids.as_numpy()]
        if not all(rows) or not all(t < vocab_size for row in rows for t in row):
            raise ValueError(f"input: token ids must be in [0, {vocab_size}) and a list must not be empty")
        longest = max(len(row) for row in rows)
        if longest > self.encoder.max_seq_length:  # ids are taken as given, so never cut
            raise ValueError(f"input: a token-id list holds {longest} ids, more than this model's "
                             f"{self.encoder.max_seq_length}")
        return rows

    def finalize(self) -> None:
        self.encoder = None
