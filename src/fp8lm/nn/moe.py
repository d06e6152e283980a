"""`MoE`: a mixture-of-experts MLP, its router and its load-balancing loss.

Each token goes to its ``top_k`` experts out of ``num_experts``, chosen by a router (`Router`, a
bias-free linear map to one logit per expert, computed in FP32 outside autocast: the routing
decisions are not made in low precision):

- ``"softmax"``: the experts with the largest softmax probabilities (Switch, Mixtral);
- ``"sigmoid"``: the experts with the largest sigmoid scores (DeepSeek-V3).

With ``top_k > 1`` the chosen experts' weights are their probabilities (scores) renormalized to
sum to 1; with ``top_k = 1`` the weight is the probability itself, so the loss still trains the
router. No token is dropped by default: every expert takes every token routed to it. With a
``capacity_factor`` ``c`` an expert takes at most ``ceil(c * T * k / E)`` of a forward's ``T * k``
routed slots, the first tokens first (Switch's capacity); the slots beyond it are dropped (their
token keeps its other experts and the residual path), counted in ``dropped``.

The tokens are sorted by expert and the experts' two layers are `GroupedLinear`s (which
`fp8lm.initialize` turns into `FP8GroupedLinear`: FP8 GEMMs with one scale per expert), with a GELU
or a SwiGLU between them, no biases; the outputs are summed back per token in FP32, weighted.
An optional shared expert (any module, e.g. a dense MLP) sees every token and is added.

`load_balance_loss` is the Switch Transformer's auxiliary loss, ``E * sum_e f_e * P_e`` (``f_e``:
the share of routed token slots that went to expert ``e``; ``P_e``: the mean router probability of
``e``, for sigmoid scores normalized per token), 1 when the load is uniform. A forward in training
mode keeps it in ``aux_loss`` for the model to add to its loss (`take_aux_loss`), and counts the tokens each expert
received in ``routed`` (`take_routed` reads and clears it; `load_balance` summarizes it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import is_recomputing
from .grouped import GroupedLinear, groups_of
from .saved import SwiGLU

__all__ = [
    "MoE",
    "Router",
    "ROUTERS",
    "EXPERT_ACTIVATIONS",
    "route",
    "load_balance_loss",
    "load_balance",
    "expert_counts",
    "replace_mixtures",
]

ROUTERS = ("softmax", "sigmoid")
EXPERT_ACTIVATIONS = ("gelu", "swiglu")


def route(logits: torch.Tensor, top_k: int, router: str = "softmax") -> tuple[torch.Tensor, ...]:
    """The routing of tokens with router ``logits`` (T, E): ``(weights, experts, probs)``, the
    weights (T, k) and indices (T, k) of each token's ``top_k`` experts and the probabilities
    (T, E) that the load-balancing loss reads (module docstring); in FP32."""
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}: use one of {', '.join(ROUTERS)}")
    logits = logits.float()
    scores = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
    top, experts = scores.topk(top_k, dim=-1)
    weights = top / top.sum(-1, keepdim=True) if top_k > 1 else top
    probs = scores if router == "softmax" else scores / scores.sum(-1, keepdim=True)
    return weights, experts, probs


def load_balance_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch's auxiliary loss ``E * sum_e f_e * P_e`` of router probabilities ``probs`` (T, E) and
    the chosen experts ``experts`` (T, k): 1 for a uniform load, up to E when one expert takes all;
    its gradient reaches the router through ``P_e``."""
    num_experts = probs.shape[-1]
    share = expert_counts(experts, num_experts).to(probs.dtype) / max(experts.numel(), 1)
    return num_experts * (share * probs.mean(0)).sum()


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the slots ``experts`` (indices, any shape) chose each expert: (E,) int64. On the
    slots' device without a host read (``torch.bincount`` reads the largest index on a GPU)."""
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def load_balance(counts: torch.Tensor) -> dict[str, float]:
    """How evenly tokens were routed, from the tokens per expert ``counts``: ``max_over_mean``
    (the busiest expert's load over the mean, 1 when uniform) and ``cv`` (the coefficient of
    variation, standard deviation over mean, 0 when uniform)."""
    c = counts.double()
    mean = float(c.mean())
    if mean == 0:
        return {"max_over_mean": math.nan, "cv": math.nan}
    return {"max_over_mean": float(c.max()) / mean, "cv": float(c.std(unbiased=False)) / mean}


class Router(nn.Module):
    """One logit per expert, ``x W^T`` with ``W`` (num_experts, dim), in FP32 outside autocast
    (a weight that FSDP2's BF16 policy gathers in BF16 is widened)."""

    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        nn.init.uniform_(self.weight, -1 / math.sqrt(dim), 1 / math.sqrt(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())


class MoE(nn.Module):
    """A mixture-of-experts MLP ``dim -> hidden -> dim`` (module docstring): ``forward(x)`` for
    ``x`` of shape (..., dim)."""

    routed: torch.Tensor
    dropped: torch.Tensor

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int = 2,
        *,
        router: str = "softmax",
        activation: str = "gelu",
        shared_expert: nn.Module | None = None,
        capacity_factor: float | None = None,
    ) -> None:
        super().__init__()
        if capacity_factor is not None and not (math.isfinite(capacity_factor) and capacity_factor > 0):
            raise ValueError(
                f"capacity_factor must be a finite number > 0 (None: no token dropped), got {capacity_factor}"
            )
        self.capacity_factor = capacity_factor
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"an MoE needs >= 1 expert and 1 <= top_k <= experts; got {num_experts} and {top_k}")
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}: use one of {', '.join(ROUTERS)}")
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"unknown expert activation {activation!r}: use one of {', '.join(EXPERT_ACTIVATIONS)}")
        self.num_experts, self.top_k, self.router_kind = num_experts, top_k, router
        self.router = Router(dim, num_experts)
        swiglu = activation == "swiglu"
        # SwiGLU's gate and up projections are one grouped layer, split by the activation.
        self.c_fc = GroupedLinear(num_experts, dim, 2 * hidden if swiglu else hidden)
        self.act = SwiGLU() if swiglu else nn.GELU()
        self.c_proj = GroupedLinear(num_experts, hidden, dim)
        self.shared = shared_expert
        self.aux_loss: torch.Tensor | None = None
        self.register_buffer("routed", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weights, experts, probs = route(self.router(x2), self.top_k, self.router_kind)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # token slots sorted by expert, each expert's in token order
        routed = counts = expert_counts(flat, self.num_experts)
        if self.capacity_factor is not None:
            order, counts = self._within_capacity(flat, order, counts)
        token = order // self.top_k
        y = self.run_experts(x2[token], counts)
        out = torch.zeros(x2.shape, dtype=torch.float32, device=x.device)
        out = out.index_add(0, token, y.float() * weights.reshape(-1)[order, None])
        out = out.to(y.dtype)
        if self.shared is not None:
            out = out + self.shared(x2)
        if self.training:
            aux, routed = self.balance(probs, experts, routed)  # recomputed too: checkpointing saves the same tensors
            if not is_recomputing():  # activation checkpointing's second forward: kept and counted once
                self.aux_loss = aux
                self.routed += routed
        return out.reshape(*shape[:-1], out.shape[-1])

    def _share_state_of(self, moe: MoE) -> None:
        """Take ``moe``'s settings and modules as this mixture's own (the same modules, so the same
        parameters under the same names), with fresh counters: for subclasses that run ``moe``
        another way (`fp8lm.distributed.ExpertParallelMoE`, `SequenceParallelMoE`)."""
        self.num_experts, self.top_k, self.router_kind = moe.num_experts, moe.top_k, moe.router_kind
        self.capacity_factor = moe.capacity_factor
        self.router, self.c_fc, self.act, self.c_proj, self.shared = (
            moe.router,
            moe.c_fc,
            moe.act,
            moe.c_proj,
            moe.shared,
        )
        self.aux_loss = None
        self.register_buffer("routed", torch.zeros_like(moe.routed), persistent=False)
        self.register_buffer("dropped", torch.zeros_like(moe.dropped), persistent=False)

    def balance(self, probs: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor):
        """The forward's load-balancing loss and tokens routed to each expert, from its router
        probabilities ``probs`` (T, E), chosen ``experts`` (T, k) and their ``counts`` (E,)
        (`fp8lm.distributed.SequenceParallelMoE`: over the whole sequences of which it has a slice)."""
        return load_balance_loss(probs, experts), counts

    def _within_capacity(self, flat: torch.Tensor, order: torch.Tensor, counts: torch.Tensor):
        """The sorted slots that fit their expert's capacity, and the experts' counts of them."""
        assert self.capacity_factor is not None
        capacity = math.ceil(self.capacity_factor * flat.numel() / self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=order.device) - starts[flat[order]]
        kept = position < capacity
        if self.training and not is_recomputing():
            self.dropped += (~kept).sum()
        return order[kept], counts.clamp(max=capacity)

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for tokens ``x`` sorted by expert, ``counts`` (E,) of them each
        (`fp8lm.distributed.ExpertParallelMoE` runs them on the ranks that hold them). The groups
        stay on the device: no host read of the counts (`fp8lm.nn.grouped.Groups`)."""
        groups = groups_of(counts, self.num_experts, x.shape[0], x.device)
        return self.c_proj(self.act(self.c_fc(x, groups)), groups)

    def take_aux_loss(self) -> torch.Tensor | None:
        """The load-balancing loss of the last training forward (None: none since the last call);
        cleared, so the module holds no autograd graph between steps."""
        aux, self.aux_loss = self.aux_loss, None
        return aux

    def take_routed(self) -> torch.Tensor:
        """The tokens routed to each expert by the training forwards since the last call (dropped
        ones included); cleared, as ``dropped`` is."""
        counts = self.routed.clone()
        self.routed.zero_()
        self.dropped.zero_()
        return counts

    def extra_repr(self) -> str:
        capacity = "" if self.capacity_factor is None else f", capacity_factor={self.capacity_factor}"
        return f"num_experts={self.num_experts}, top_k={self.top_k}, router={self.router_kind}{capacity}"


def replace_mixtures(model: nn.Module, make, kinds: tuple[type, ...] = ()) -> nn.Module:
    """Every plain `MoE` of ``model`` (and every module of exactly a type in ``kinds``) replaced, in
    place, by ``make(moe)``; returns ``model``."""
    targets = [(name, m) for name, m in model.named_modules() if type(m) in (MoE, *kinds)]
    for name, moe in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(moe))
    return model
