"""tritonllm's engine: `from backend import LLM, SamplingParams` mirrors vLLM's offline API."""

from backend.config import EngineConfig
from backend.lora import LoRARequest
from backend.outputs import CompletionOutput, Logprob, RequestOutput
from backend.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from backend.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str):
    # The engine pulls in torch; import it only when asked for.
    if name == "LLM":
        from backend.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from backend.engine.engine import LLMEngine
        return LLMEngine
    if name == "AsyncLLMEngine":
        from backend.engine.async_engine import AsyncLLMEngine
        return AsyncLLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineConfig", "LoRARequest", "SamplingParams", "BeamSearchParams",
           "BeamSearchOutput", "BeamSearchSequence",
           "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob"]
