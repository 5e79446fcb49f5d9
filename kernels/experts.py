"""The experts of one MoE layer, as the MoE kernels (moe.py) take them: each
projection of every expert stacked (``ExpertWeights``), and a layer's gated MLPs
(``ExpertMLP``): ``gate_up`` is ``[E, 2I, H]`` (each expert's gate rows, then its up
rows), ``down`` is ``[E, H, I]``, with optional per-expert biases (GPT-OSS) and the
gate's activation (``GatedActivation``: SwiGLU, or GPT-OSS's clamped variant).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from . import cpu_library, quant_linear_cpu
from .quant_linear_cpu import TiledWeight
from .quant_weight import QuantWeight, concat_rows


@dataclass(slots=True)
class ExpertWeights:
    """One projection of every expert, ``[num_experts, out_features, in_features]``:
    a dense tensor of that shape, or a QuantWeight whose rows are the experts' rows one
    expert after another (``num_experts * out_features`` rows) and whose ``perm`` is
    None; ``perms`` then holds each expert's GPTQ act-order ``[E, in_features]``. On the
    CPU a QuantWeight stack may be tiled for the int8 kernel (``for_int8_kernel``): a
    TiledWeight whose experts start on tile boundaries."""

    weight: torch.Tensor | QuantWeight | TiledWeight
    num_experts: int
    perms: torch.Tensor | None = None
    # Each expert's view, made once: a CPU decode step takes 16 or more per layer.
    _views: list[QuantWeight | TiledWeight] | None = field(default=None, init=False, repr=False, compare=False)
    # A tiled stack's experts as one table for the grouped int8 kernel, made once.
    _table: ctypes.Array | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.weight, TiledWeight):
            if self.weight.out_features % self.num_experts or self.perms is not None:
                raise ValueError(f"a tiled stack splits into {self.num_experts} experts and has no act-order")
        elif isinstance(self.weight, QuantWeight):
            if self.weight.perm is not None:
                raise ValueError("a stacked QuantWeight keeps act-order in perms, not perm")
            if self.weight.out_features % self.num_experts:
                raise ValueError(f"{self.weight.out_features} rows do not split into {self.num_experts} experts")
        elif self.weight.dim() != 3 or self.weight.shape[0] != self.num_experts:
            raise ValueError(f"dense expert weights must be [{self.num_experts}, N, K], got {tuple(self.weight.shape)}")
        elif self.perms is not None:
            raise ValueError("act-order perms belong to quantized experts only")
        if self.perms is not None and tuple(self.perms.shape) != (self.num_experts, self.in_features):
            raise ValueError(f"perms must be [{self.num_experts}, {self.in_features}]")

    @property
    def quantized(self) -> bool:
        return not isinstance(self.weight, torch.Tensor)

    @property
    def out_features(self) -> int:
        if isinstance(self.weight, torch.Tensor):
            return self.weight.shape[1]
        return self.weight.out_features // self.num_experts

    @property
    def in_features(self) -> int:
        return self.weight.shape[2] if isinstance(self.weight, torch.Tensor) else self.weight.in_features

    @property
    def device(self) -> torch.device:
        return self.weight.device if isinstance(self.weight, torch.Tensor) else self.weight.codes.device

    @property
    def nbytes(self) -> int:
        extra = 0 if self.perms is None else self.perms.numel() * self.perms.element_size()
        if isinstance(self.weight, torch.Tensor):
            return self.weight.numel() * self.weight.element_size() + extra
        return self.weight.nbytes + extra

    def expert(self, e: int) -> torch.Tensor | QuantWeight | TiledWeight:
        """Expert ``e``'s ``[out_features, in_features]`` weight (a view)."""
        if isinstance(self.weight, torch.Tensor):
            return self.weight[e]
        if self._views is None:
            n, perms = self.out_features, self.perms
            views = [self.weight.row_range(i * n, (i + 1) * n) for i in range(self.num_experts)]
            self._views = views if perms is None else [replace(v, perm=perms[i]) for i, v in enumerate(views)]  # type: ignore[type-var]
        return self._views[e]

    def table(self) -> ctypes.Array:
        """A tiled stack's experts as the C++ kernels' table of weight descriptors (made once)."""
        if not isinstance(self.weight, TiledWeight):
            raise TypeError("only tiled stacks (for_int8_kernel) have a kernel table")
        if self._table is None:
            self._table = quant_linear_cpu.weight_table([self.expert(e) for e in range(self.num_experts)])  # type: ignore[misc]
        return self._table

    def grouped_linear(self, x: torch.Tensor, ids: list[int], counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` grouped by expert (``counts[i]`` rows for expert ``ids[i]``, one
        group after another) through their experts in one call: tiled stacks only."""
        return quant_linear_cpu.grouped_int8_linear(x, self.table(), ids, counts, self.out_features)

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> ExpertWeights:
        if isinstance(self.weight, TiledWeight):
            if device.type != "cpu":
                raise ValueError("experts tiled for the CPU's int8 kernel stay on the CPU")
            return self
        if isinstance(self.weight, QuantWeight):
            weight: torch.Tensor | QuantWeight = self.weight.to(device)
        else:
            weight = self.weight.to(device, dtype or self.weight.dtype)
        perms = None if self.perms is None else self.perms.to(device)
        return ExpertWeights(weight, self.num_experts, perms)

    def for_int8_kernel(self) -> ExpertWeights:
        """This stack tiled for the CPU's int8 kernel when the kernel takes it and each
        expert starts on a tile; else itself."""
        weight = self.weight
        if (isinstance(weight, QuantWeight) and self.perms is None and cpu_library.available()
                and self.out_features % cpu_library.lanes() == 0 and quant_linear_cpu.can_tile(weight)):
            return ExpertWeights(quant_linear_cpu.tile(weight), self.num_experts)
        return self

    @classmethod
    def stack(cls, experts: list[torch.Tensor | QuantWeight]) -> ExpertWeights:
        """Stack per-expert ``[N, K]`` weights (all dense or all quantized alike)."""
        if all(isinstance(w, torch.Tensor) for w in experts):
            return cls(torch.stack(experts), len(experts))  # type: ignore[arg-type]
        if not all(isinstance(w, QuantWeight) for w in experts):
            raise ValueError("experts mix dense and quantized weights")
        quantized: list[QuantWeight] = experts  # type: ignore[assignment]
        # GPTQ v1 widens a zero point of 256 to int16 in some experts only: widen all.
        if any(w.zeros is not None and w.zeros.dtype == torch.int16 for w in quantized):
            quantized = [replace(w, zeros=w.zeros.to(torch.int16)) for w in quantized]  # type: ignore[union-attr]
        perms = None
        if any(w.perm is not None for w in quantized):
            identity = torch.arange(quantized[0].in_features)
            perms = torch.stack([identity if w.perm is None else w.perm for w in quantized])
        return cls(concat_rows(quantized), len(experts), perms)


def _fuse_outputs(parts: list[ExpertWeights]) -> ExpertWeights | None:
    """Per expert, the rows of ``parts[0]`` then those of ``parts[1]`` (gate and up into
    one gate_up), or None when they cannot share one matmul (different layouts, or
    different GPTQ act-orders)."""
    first = parts[0]
    if all(isinstance(p.weight, torch.Tensor) for p in parts):
        if any(p.weight.dtype != first.weight.dtype for p in parts):  # type: ignore[union-attr]
            return None
        return ExpertWeights(torch.cat([p.weight for p in parts], dim=1), first.num_experts)  # type: ignore[misc]
    if not all(isinstance(p.weight, QuantWeight) and p.weight.layout() == first.weight.layout() for p in parts):
        return None
    if any((p.perms is None) != (first.perms is None) or (p.perms is not None and not torch.equal(p.perms, first.perms))
           for p in parts):
        return None
    per_expert = [concat_rows([replace(p.expert(e), perm=None) for p in parts])  # type: ignore[misc]
                  for e in range(first.num_experts)]
    return ExpertWeights(concat_rows(per_expert), first.num_experts, first.perms)


@dataclass(frozen=True, slots=True)
class GatedActivation:
    """``act(gate) * up``: SwiGLU (``silu(gate) * up``) by default; GPT-OSS's experts clamp
    the gate above at ``limit`` and the up projection to +-``limit``, and compute
    ``gate * sigmoid(alpha * gate) * (up + up_offset)``."""

    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None and self.alpha == 1.0 and self.up_offset == 0.0:
            return F.silu(gate) * up
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + self.up_offset) * (gate * torch.sigmoid(gate * self.alpha))


SWIGLU = GatedActivation()


@dataclass(slots=True)
class ExpertMLP:
    """Every expert of one MoE layer: gated MLPs ``hidden -> intermediate -> hidden``.
    ``gate_up`` is one fused ``[E, 2I, H]`` projection, or gate and up apart when their
    weights cannot be fused; ``gate_up_bias`` ``[E, 2I]`` (gate's, then up's) and
    ``down_bias`` ``[E, H]`` are each expert's biases, when it has them."""

    gate_up: list[ExpertWeights]
    down: ExpertWeights
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    activation: GatedActivation = SWIGLU

    @classmethod
    def from_projections(cls, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights,
                         biases: tuple[torch.Tensor, ...] | None = None,
                         activation: GatedActivation = SWIGLU) -> ExpertMLP:
        fused = _fuse_outputs([gate, up])
        gate_up_bias = torch.cat(biases[:2], dim=1) if biases is not None else None
        down_bias = biases[2] if biases is not None else None
        return cls([fused] if fused is not None else [gate, up], down, gate_up_bias, down_bias, activation)

    def activate(self, hidden: torch.Tensor, experts: torch.Tensor | int) -> torch.Tensor:
        """``act(gate) * up`` from gate_up's outputs ``hidden [rows, 2I]``, each row's
        expert (``experts``: one id for all, or one per row) adding its biases first."""
        if self.gate_up_bias is not None:
            hidden = hidden + self.gate_up_bias[experts].to(hidden.dtype)
        gate, up = hidden.split(self.intermediate_size, dim=-1)
        return self.activation(gate, up)

    def add_down_bias(self, out: torch.Tensor, experts: torch.Tensor | int) -> torch.Tensor:
        """down's outputs ``out [rows, H]`` plus each row's expert's bias (when it has them)."""
        return out if self.down_bias is None else out + self.down_bias[experts].to(out.dtype)

    def down_bias_sum(self, gates: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token's ``sum_j gates[t, j] * down_bias[ids[t, j]]`` (fp32 ``[T, H]``), for a
        kernel that weights and sums the experts' outputs before any bias is added."""
        assert self.down_bias is not None
        return (gates.float().unsqueeze(-1) * self.down_bias[ids].float()).sum(dim=1)

    @property
    def num_experts(self) -> int:
        return self.down.num_experts

    @property
    def intermediate_size(self) -> int:
        return self.down.in_features

    @property
    def device(self) -> torch.device:
        return self.down.device

    @property
    def quantized(self) -> bool:
        return self.down.quantized or any(p.quantized for p in self.gate_up)

    @property
    def tiled(self) -> bool:
        """gate_up as one tiled stack, and down tiled: the grouped int8 kernel runs them."""
        return len(self.gate_up) == 1 and all(isinstance(p.weight, TiledWeight) for p in (*self.gate_up, self.down))

    @property
    def nbytes(self) -> int:
        biases = sum(b.numel() * b.element_size() for b in (self.gate_up_bias, self.down_bias) if b is not None)
        return self.down.nbytes + sum(p.nbytes for p in self.gate_up) + biases

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> ExpertMLP:
        def bias(b: torch.Tensor | None) -> torch.Tensor | None:
            return None if b is None else b.to(device, dtype or b.dtype)

        return replace(self, gate_up=[p.to(device, dtype) for p in self.gate_up], down=self.down.to(device, dtype),
                       gate_up_bias=bias(self.gate_up_bias), down_bias=bias(self.down_bias))

    def for_int8_kernel(self) -> ExpertMLP:
        """The projections the CPU's int8 kernel takes, tiled for it (see ExpertWeights)."""
        return replace(self, gate_up=[p.for_int8_kernel() for p in self.gate_up], down=self.down.for_int8_kernel())


Linear = Callable[[torch.Tensor, torch.Tensor | QuantWeight | TiledWeight], torch.Tensor]


def expert_mlp(rows: torch.Tensor, experts: ExpertMLP, expert: int, linear: Linear) -> torch.Tensor:
    """Expert ``expert``'s gated MLP over ``rows``, its matmuls done by ``linear``."""
    parts = [linear(rows, p.expert(expert)) for p in experts.gate_up]
    hidden = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return experts.add_down_bias(linear(experts.activate(hidden, expert), experts.down.expert(expert)), expert)
