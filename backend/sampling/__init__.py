"""Logits to tokens: the sampler (penalties, temperature, top-k/p/min-p, seeds, logprobs), structured
output's grammar masks, and prompt logprobs."""
