"""The building blocks every decoder family shares: norms, rotary embeddings, gated activations, the
attention block (and DeepSeek's latent attention) and mixture-of-experts layers. A family chooses
among their options in its config mapping."""
