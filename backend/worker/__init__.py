"""Execution: the model runner (a step's plan to flat tensors, the model, logits), model loading,
CUDA graphs, and the tensor/pipeline-parallel ranks and their process group."""
