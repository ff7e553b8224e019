"""Triton's embeddings model: texts in, L2-normalised sentence embeddings out.

It computes what sentence-transformers computes for all-MiniLM-L6-v2 (Transformer -> mean pooling
over the attention mask -> Normalize), with plain transformers and torch, and never touches the
Hugging Face hub. Triton's dynamic batcher hands several requests to `execute` at once; their texts
go through the model as one batch.
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
        limit = json.loads(config.read_text()).get("max_seq_length") if config.is_file() else None
        self.max_seq_length = limit or self.tokenizer.model_max_length

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        batch = self.tokenizer(texts, padding=True, truncation="longest_first",
                               max_length=self.max_seq_length, return_tensors="pt").to(self.device)
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
        texts_per_request = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1)
            texts_per_request.append([v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)
                                      for v in values])
        try:
            embeddings, num_tokens = self.encoder.encode([t for texts in texts_per_request for t in texts])
        except Exception as error:  # one failed batch answers every request in it
            message = pb_utils.TritonError(f"embedding failed: {error}", pb_utils.TritonError.INTERNAL)
            return [pb_utils.InferenceResponse(error=message) for _ in requests]
        responses, start = [], 0
        for texts in texts_per_request:
            end = start + len(texts)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("embedding", embeddings[start:end].astype(np.float32)),
                pb_utils.Tensor("num_tokens", num_tokens[start:end].astype(np.int32).reshape(-1, 1)),
            ]))
            start = end
        return responses

    def finalize(self) -> None:
        self.encoder = None
