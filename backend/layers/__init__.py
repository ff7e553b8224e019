"""The building blocks every decoder family shares: norms, rotary embeddings, gated activations, the
attention block (and DeepSeek's latent attention), mixture-of-experts layers, and the weight loaders
that shard their parameters per tensor rank (`sharding.py`). A family chooses among their options
in its config mapping."""
