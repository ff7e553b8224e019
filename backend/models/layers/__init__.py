"""The building blocks every decoder family shares: norms, rotary embeddings, gated activations and
the attention block. A family chooses among their options in its config mapping."""
