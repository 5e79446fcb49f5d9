"""Mixture-of-experts MLP: route each token to its top-k experts, run those experts'
SwiGLU MLPs, and sum their outputs weighted by the router's gates.

Expert weights are stacked per projection (``ExpertWeights``): ``gate_up`` is
``[E, 2I, H]`` (each expert's gate rows, then its up rows), ``down`` is ``[E, H, I]``.
A token's output is ``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`` over its chosen
experts ``e = ids[j]`` with gates ``w_j`` (experts.py holds the weights; GPT-OSS's
experts add biases and clamp their activation: ``ExpertMLP.activate``, ``add_down_bias``).

Three implementations, one definition:

- ``moe_ref.fused_moe_ref``: the plain per-expert loop, the definition of correct.
- ``moe_triton``: on CUDA, tokens are sorted by expert so that each program of a
  grouped GEMM reads one expert's weight tile once for a block of its tokens; experts
  no token chose get no programs.
- ``fused_moe_cpu`` (here): on CPU, one sort groups the (token, expert) pairs; only the
  experts that were chosen run, each over its rows: GGUF's quantized experts through the
  int8 kernel (x rounded to int8 as llama.cpp rounds it), every chosen expert of a
  projection in one grouped call; other experts one matmul each (the fp32 kernel for
  GPTQ/AWQ).

When the experts live on another device than the activations (``cpu_moe``: experts
in host RAM, the rest on the GPU), the tokens travel to the experts and back.
"""

from __future__ import annotations

import torch

from .dispatch import use_triton
from .experts import ExpertMLP, expert_mlp
from .moe_ref import fused_moe_ref
from .quant_linear import linear


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts: gates (fp32 ``[T, k]``, softmax over all experts,
    then rescaled to sum to 1 when ``renormalize``) and expert ids (int64 ``[T, k]``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    gates, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates, ids


def fused_moe(x: torch.Tensor, experts: ExpertMLP, gates: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The experts' weighted output ``[T, H]`` for tokens ``x [T, H]`` routed to experts
    ``ids [T, k]`` with ``gates [T, k]``; in ``x``'s dtype on ``x``'s device."""
    if experts.device != x.device:
        # Experts held elsewhere (cpu_moe): compute there, in fp32 when the experts are
        # quantized (the CPU kernels take fp32), else in the experts' own dtype.
        dtype = torch.float32 if experts.quantized else experts.down.weight.dtype  # type: ignore[union-attr]
        out = fused_moe(x.to(experts.device, dtype), experts, gates.to(experts.device), ids.to(experts.device))
        return out.to(x.device, x.dtype)
    if use_triton(x):
        from . import moe_triton

        if moe_triton.supports(experts):
            return moe_triton.fused_moe(x, experts, gates, ids)
    if x.device.type == "cpu":
        return fused_moe_cpu(x, experts, gates, ids)
    return fused_moe_ref(x, experts, gates, ids)


def fused_moe_cpu(x: torch.Tensor, experts: ExpertMLP, gates: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Group the (token, expert) pairs with one sort and run only the chosen experts,
    each once over all of its rows: tiled experts all in one grouped kernel call per
    projection, others one expert after another."""
    num_tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pair indices, grouped by expert
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
    tokens = order // top_k  # each pair's token, in expert order
    rows = x.index_select(0, tokens)
    pair_gates = gates.reshape(-1).index_select(0, order).float().unsqueeze(1)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    if experts.tiled:
        chosen = [e for e, count in enumerate(counts) if count]
        chosen_counts = [counts[e] for e in chosen]
        hidden = experts.gate_up[0].grouped_linear(rows, chosen, chosen_counts)
        pair_experts = flat_ids[order]
        y = experts.down.grouped_linear(experts.activate(hidden, pair_experts), chosen, chosen_counts)
        y = experts.add_down_bias(y, pair_experts)
        out.index_add_(0, tokens, y * pair_gates)  # each token's k outputs summed in fp32
        return out.to(x.dtype)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        stop = start + count
        y = expert_mlp(rows[start:stop], experts, expert, linear)
        # Each token's k outputs are summed in fp32.
        out.index_add_(0, tokens[start:stop], y.float() * pair_gates[start:stop])
        start = stop
    return out.to(x.dtype)
