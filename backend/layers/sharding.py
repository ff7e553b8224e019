"""Weight loaders: how one parameter takes its checkpoint tensor on this tensor rank. A layer names a
loader for each of its parameters and child layers that is not a whole copy (`weight_loaders`), and
`models/loading.py` calls it as `loader(param, tensor, part)`.

Megatron-style sharding: a column-parallel layer keeps its rank's rows of the output (q heads,
gate/up, latent attention's q and kv_b), key/value heads are split too unless the ranks outnumber
them (then each rank keeps a copy of the head its ranks share), a row-parallel layer keeps its
columns of the input (o_proj, down_proj; a bias, added once after the all-reduce, lives on rank 0),
and the embedding and LM head keep a slice of the vocabulary padded to a multiple of the ranks.
Everything else is replicated.

A packed layer holds several checkpoint layers' outputs one after another (q/k/v in qkv_proj,
gate/up in gate_up_proj): each part arrives with its index, is sharded and written into its slice.
Quantized layers pack along their own dim (AWQ's qweight along dim 1); a part shaped like the
whole parameter is one copy every part carries (GPTQ's g_idx), checked equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend.worker.parallel_state import ParallelState

Shard = Callable[[torch.Tensor], torch.Tensor]
WeightLoader = Callable[[torch.Tensor, torch.Tensor, "int | None"], None]  # (param, tensor, part)


def copy_whole(param: torch.Tensor, tensor: torch.Tensor, part: int | None = None) -> None:
    """A replicated parameter: the checkpoint's tensor as it is (cast to the parameter's dtype)."""
    param.copy_(tensor)


def output_rows(parallel: ParallelState) -> Shard:
    """Column-parallel: this rank's rows of the output dim."""
    tp, rank = parallel.tp_size, parallel.tp_rank
    return (lambda tensor: tensor) if tp == 1 else (lambda tensor: tensor.chunk(tp, dim=0)[rank])


def head_rows(parallel: ParallelState, num_heads: int) -> Shard:
    """Key/value heads: split like any column-parallel output, or, when the ranks outnumber the
    heads, the whole head this rank's group of ranks shares."""
    tp, rank = parallel.tp_size, parallel.tp_rank
    if num_heads % tp == 0:
        return output_rows(parallel)
    head = rank * num_heads // tp
    return lambda tensor: tensor.view(num_heads, -1, *tensor.shape[1:])[head]


def sharded(shard: Shard) -> WeightLoader:
    def load(param: torch.Tensor, tensor: torch.Tensor, part: int | None = None) -> None:
        param.copy_(shard(tensor))
    return load


def column_parallel(parallel: ParallelState) -> WeightLoader:
    return sharded(output_rows(parallel))


def row_parallel(parallel: ParallelState) -> WeightLoader:
    """This rank's columns of the input dim; a bias whole on rank 0 and zero elsewhere, so the
    all-reduce after the layer adds it once."""
    tp, rank = parallel.tp_size, parallel.tp_rank

    def load(param: torch.Tensor, tensor: torch.Tensor, part: int | None = None) -> None:
        if tp == 1:
            param.copy_(tensor)
        elif tensor.dim() == 1 and rank == 0:
            param.copy_(tensor)
        elif tensor.dim() == 1:
            param.zero_()
        else:
            param.copy_(tensor.chunk(tp, dim=1)[rank])
    return load


def vocab_parallel(parallel: ParallelState, vocab_per_rank: int) -> WeightLoader:
    """This rank's rows of an embedding or LM head, the vocabulary zero-padded to vocab_per_rank * tp."""
    tp, start = parallel.tp_size, parallel.tp_rank * vocab_per_rank

    def load(param: torch.Tensor, tensor: torch.Tensor, part: int | None = None) -> None:
        if tp == 1:
            param.copy_(tensor)
            return
        padded = torch.zeros(vocab_per_rank * tp, tensor.shape[1], dtype=tensor.dtype)
        padded[:tensor.shape[0]] = tensor
        param.copy_(padded[start:start + vocab_per_rank])
    return load


@dataclass(frozen=True)
class Part:
    """One checkpoint layer inside a packed layer: its output size in the checkpoint, on this rank,
    and how this rank's rows are cut from it."""
    size: int
    local_size: int
    shard: Shard


def packed_dim(param: torch.Tensor, piece: torch.Tensor) -> int | None:
    """The dim a part fills a slice of: the one where it is smaller than the packed parameter (dim 0
    for nn.Linear, a quantized layout's own); None for a part shaped like the whole parameter."""
    if piece.dim() != param.dim():
        raise ValueError(f"a packed part of shape {list(piece.shape)} does not fit a parameter of {list(param.shape)}")
    differing = [dim for dim in range(param.dim()) if piece.shape[dim] != param.shape[dim]]
    if len(differing) > 1:
        raise ValueError(f"a packed part of shape {list(piece.shape)} does not fit a parameter of {list(param.shape)}")
    return differing[0] if differing else None


def packed(parts: list[Part], tp_size: int) -> WeightLoader:
    """A packed column-parallel layer (q/k/v, gate/up): part i sharded into its slice; a checkpoint
    storing the layer fused already (Phi-3's qkv_proj, gate_up_proj) is split into its parts first."""
    local_sizes = [p.local_size for p in parts]
    holding_a_copy: set[int] = set()  # id() of the shared-copy parameters written already (all alive while loading)

    def load(param: torch.Tensor, tensor: torch.Tensor, part: int | None = None) -> None:
        if part is None:
            if tensor.shape[0] == sum(p.size for p in parts):
                for index, piece in enumerate(tensor.split([p.size for p in parts])):
                    load(param, piece, index)
                return
            if tp_size > 1:  # a quantized layout, already the packed layer's on one rank
                raise ValueError("a fused quantized checkpoint tensor cannot be split for tensor parallelism")
            param.copy_(tensor)
            return
        piece = parts[part].shard(tensor)
        dim = packed_dim(param, piece)
        if dim is None:  # one copy every part carries: the first written, the others checked against it
            if id(param) in holding_a_copy and not torch.equal(param, piece.to(param.dtype)):
                raise ValueError("the packed layers' copies of a shared tensor differ")
            param.copy_(piece)
            holding_a_copy.add(id(param))
            return
        offset = sum(local_sizes[:part]) * param.shape[dim] // sum(local_sizes)
        param.narrow(dim, offset, piece.shape[dim]).copy_(piece)
    return load
