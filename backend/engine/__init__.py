"""The loop and its doors: `LLMEngine` (add, step, abort), the async engine servers drive, the offline
`LLM`, and what turns sampled tokens into client outputs (detokenizer, output processor, beam search,
metrics), with speculative decoding's proposers."""
