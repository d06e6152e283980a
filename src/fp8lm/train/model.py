"""A nanoGPT-like decoder in two architectures (``GPTConfig.arch``), pre-norm blocks and causal
`scaled_dot_product_attention` in both:

- ``gpt`` (GPT-2): learned position embeddings, LayerNorm, multi-head attention with one fused
  q/k/v layer, a GELU (or SwiGLU) MLP, biases;
- ``llama``: rotary position embeddings (`apply_rope`), `RMSNorm`, grouped-query attention
  (``n_kv_head`` key/value heads, each shared by ``n_head / n_kv_head`` query heads: a q layer
  and a fused k/v layer), a SwiGLU MLP, no biases.

Either may replace every block's MLP by a mixture of experts (``moe_experts`` > 0: `fp8lm.nn.MoE`,
``moe_top_k`` experts per token, experts of the architecture's MLP kind without biases, an
optional dense shared expert); in training the mean over blocks of their load-balancing losses,
times ``moe_aux_loss_coef``, is added to the loss (and kept in ``GPT.moe_aux_loss``).

Every weight matrix is an `nn.Linear` whose dimensions are multiples of 16 (for the presets), so
`fp8lm.initialize` turns all of them, the output head included, into FP8 layers. The output head
is not tied to the token embedding: a tied weight would be one tensor in two formats (an FP8
GEMM operand and an embedding table).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..nn.checkpoint import checkpoint
from ..nn.grouped import GroupedLinear
from ..nn.moe import ROUTERS, MoE, Router
from ..nn.saved import RMSNorm, ScaledDotProductAttention, SwiGLU, rms_norm

__all__ = [
    "GPTConfig",
    "GPT",
    "PRESETS",
    "ARCHS",
    "MLP_KINDS",
    "CHECKPOINTING",
    "ROUTERS",
    "preset",
    "RMSNorm",
    "rms_norm",
    "rope_angles",
    "apply_rope",
]

ARCHS = ("gpt", "llama")
MLP_KINDS = ("gelu", "swiglu")
# activation checkpointing (`GPT.checkpoint_blocks`), as torchtitan names its modes
CHECKPOINTING = ("none", "selective", "full")
# what each architecture has unless told otherwise: (mlp, bias)
_ARCH_DEFAULTS = {"gpt": ("gelu", True), "llama": ("swiglu", False)}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    block_size: int = 128  # longest sequence the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    arch: str = "gpt"
    n_kv_head: int | None = None  # key/value heads (llama); None: n_head (multi-head attention)
    mlp: str | None = None  # None: the architecture's (gpt: gelu, llama: swiglu)
    dropout: float = 0.0
    bias: bool | None = None  # None: the architecture's (gpt: biases, llama: none)
    rope_theta: float = 10000.0  # llama: base of the rotary embedding's frequencies
    norm_eps: float = 1e-5  # epsilon of LayerNorm / RMSNorm
    moe_experts: int = 0  # > 0: every block's MLP is a mixture of this many experts
    moe_top_k: int = 2  # experts per token
    moe_router: str = "softmax"  # softmax or sigmoid (fp8lm.nn.moe)
    moe_shared_expert: bool = False  # a dense MLP that every token goes through too
    moe_aux_loss_coef: float = 0.01  # weight of the load-balancing loss in the training loss
    moe_capacity_factor: float | None = None  # None: no token dropped; else each expert's capacity factor

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}: use one of {', '.join(ARCHS)}")
        mlp, bias = _ARCH_DEFAULTS[self.arch]
        # frozen: the architecture's defaults filled in once, so the saved config says what was built
        object.__setattr__(self, "mlp", mlp if self.mlp is None else self.mlp)
        object.__setattr__(self, "bias", bias if self.bias is None else self.bias)
        object.__setattr__(self, "n_kv_head", self.n_head if self.n_kv_head is None else self.n_kv_head)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"unknown mlp {self.mlp!r}: use one of {', '.join(MLP_KINDS)}")
        self._check_arch()
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not (self.rope_theta > 0 and self.norm_eps > 0):
            raise ValueError(f"rope_theta and norm_eps must be > 0, got {self.rope_theta} and {self.norm_eps}")
        self._check_moe()

    def _check_moe(self) -> None:
        if self.moe_experts < 0:
            raise ValueError(f"moe_experts must be >= 0 (0: a dense MLP), got {self.moe_experts}")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k must be in [1, moe_experts={self.moe_experts}], got {self.moe_top_k}")
        if self.moe_router not in ROUTERS:
            raise ValueError(f"unknown moe_router {self.moe_router!r}: use one of {', '.join(ROUTERS)}")
        cf = self.moe_capacity_factor
        if cf is not None and not (math.isfinite(cf) and cf > 0):
            raise ValueError(f"moe_capacity_factor must be a finite number > 0 (None: no token dropped), got {cf}")
        if not (math.isfinite(self.moe_aux_loss_coef) and self.moe_aux_loss_coef >= 0):
            raise ValueError(f"moe_aux_loss_coef must be a finite number >= 0, got {self.moe_aux_loss_coef}")

    def _check_arch(self) -> None:
        """What each architecture is: llama is SwiGLU without biases, grouped-query attention is llama's."""
        kv = self.n_kv_head
        assert kv is not None  # filled in by __post_init__
        if self.arch == "gpt" and kv != self.n_head:
            raise ValueError(
                f"n_kv_head ({kv}) differs from n_head ({self.n_head}): grouped-query attention is arch llama's"
            )
        if self.arch == "llama" and (self.mlp != "swiglu" or self.bias):
            raise ValueError("arch llama has a SwiGLU MLP and no biases: drop mlp/bias (or use arch gpt)")
        if not 1 <= kv <= self.n_head or self.n_head % kv:
            raise ValueError(f"n_kv_head ({kv}) must divide n_head ({self.n_head})")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        if self.mlp == "gelu":
            return 4 * self.n_embd
        # SwiGLU keeps the parameter count of a 4x GELU MLP (2/3 of 4x per matrix), rounded up to 16.
        return 16 * math.ceil(8 * self.n_embd / 3 / 16)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {sorted(unknown)}")
        return cls(**d)


# Sizes, for either architecture (llama: n_kv_head = n_head unless set): "tiny" for tests, "small" (the default) trains in about two minutes on two CPU cores,
# the larger ones are for GPUs.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32),
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    "base": GPTConfig(block_size=256, n_layer=8, n_head=8, n_embd=512),
    "gpt2": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


def preset(name: str, **overrides) -> GPTConfig:
    """The preset ``name`` with the fields in ``overrides`` (those not None) replaced."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: use one of {', '.join(PRESETS)}")
    # the preset's sizes; everything else (arch, and what follows from it) from ``overrides``
    base = {k: getattr(PRESETS[name], k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    base.update({k: v for k, v in overrides.items() if v is not None})
    return GPTConfig.from_dict(base)


def rope_angles(
    t: int, head_dim: int, theta: float, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the rotary angles, each (t, head_dim): position ``p`` turns channel pair
    ``(i, i + head_dim/2)`` by ``p * theta^(-2i/head_dim)`` (the "rotate half" layout of Hugging
    Face's Llama)."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)
    angles = torch.outer(torch.arange(t, device=device, dtype=dtype), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` (..., t, head_dim) rotated by `rope_angles`' angles, computed in their dtype."""
    xf = x.to(cos.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)


class CausalSelfAttention(nn.Module):
    """gpt: multi-head attention, q, k and v from one fused layer."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.sdpa = ScaledDotProductAttention()  # a module: activations="fp8" swaps it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        # Head count from c_attn's output: under tensor parallelism a rank holds only its heads.
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        heads = q.shape[-1] // self.head_dim
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = self.sdpa(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class GroupedQueryAttention(nn.Module):
    """llama: rotary positions on q and k; ``n_kv_head`` key/value heads, each serving
    ``n_head / n_kv_head`` consecutive query heads; k and v from one fused layer."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_kv_head is not None
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        self.c_q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_kv = nn.Linear(cfg.n_embd, 2 * cfg.n_kv_head * cfg.head_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.sdpa = ScaledDotProductAttention()  # a module: activations="fp8" swaps it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        # Head counts from the layers' outputs: under tensor parallelism a rank holds only its heads.
        q = self.c_q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in self.c_kv(x).chunk(2, dim=2))
        cos, sin = rope_angles(t, self.head_dim, self.theta, x.device, torch.promote_types(q.dtype, torch.float32))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = self.sdpa(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, q.shape[1] * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        hidden = cfg.mlp_hidden
        # SwiGLU's gate and up projections are one GEMM (one FP8 layer), split afterwards.
        self.c_fc = nn.Linear(cfg.n_embd, 2 * hidden if self.swiglu else hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        # modules, not functional calls, so that fp8lm.initialize(activations="fp8") can swap them
        self.act = SwiGLU() if self.swiglu else nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


def moe(cfg: GPTConfig) -> MoE:
    """A block's mixture of experts: experts of the architecture's MLP kind and size."""
    return MoE(
        cfg.n_embd,
        cfg.mlp_hidden,
        cfg.moe_experts,
        cfg.moe_top_k,
        router=cfg.moe_router,
        activation=str(cfg.mlp),
        shared_expert=MLP(cfg) if cfg.moe_shared_expert else None,
        capacity_factor=cfg.moe_capacity_factor,
    )


def embed(wte: nn.Embedding, wpe: nn.Embedding | None, idx: torch.Tensor) -> torch.Tensor:
    """The token embeddings of ``idx`` (b, t), plus the position embeddings (gpt's ``wpe``)."""
    x = wte(idx)
    if wpe is not None:
        x = x + wpe(torch.arange(idx.shape[1], device=idx.device))
    return x


def _norm(cfg: GPTConfig) -> nn.Module:
    if cfg.arch == "llama":
        return RMSNorm(cfg.n_embd, cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=bool(cfg.bias))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = _norm(cfg)
        self.attn = GroupedQueryAttention(cfg) if cfg.arch == "llama" else CausalSelfAttention(cfg)
        self.ln_2 = _norm(cfg)
        self.mlp: nn.Module = moe(cfg) if cfg.moe_experts else MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.checkpointed = False  # activation checkpointing (GPT.checkpoint_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self.body, x, scaling=self)
        return self.body(x)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # llama's positions are rotary (in its attention): no position embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.arch == "gpt" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = _norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.moe_aux_loss: torch.Tensor | None = None  # the last training forward's load-balancing loss
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth (the experts' too: c_proj.weight.<expert>).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or "c_proj.weight." in name:
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding, Router)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, GroupedLinear):
            for w in module.weight:
                nn.init.normal_(w, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def checkpoint_blocks(self, mode: str) -> None:
        """Activation checkpointing (`fp8lm.nn.checkpoint`: FP8 casts recomputed bit for bit):
        ``"none"``; ``"selective"``, every other block (the 2nd, 4th, ...: torchtitan's
        layer-selective checkpointing at frequency 2), so half the blocks keep only their input
        for backward; ``"full"``, every block."""
        if mode not in CHECKPOINTING:
            raise ValueError(f"unknown activation checkpointing {mode!r}: use one of {', '.join(CHECKPOINTING)}")
        for i, block in enumerate(self.blocks):
            block.checkpointed = mode == "full" or (mode == "selective" and i % 2 == 1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds the model's block_size {self.config.block_size}; "
                "use a shorter sequence or build the model with a larger block_size"
            )
        x = self.drop(embed(self.wte, self.wpe, idx))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
            if self.training and self.config.moe_experts:
                # under --tp the loss is a replicated DTensor (loss_parallel), the load-balancing
                # loss each rank's plain part of the whole (SequenceParallelMoE)
                loss = _local(loss) + self.config.moe_aux_loss_coef * self._aux_loss()
        return logits, loss

    def _aux_loss(self) -> torch.Tensor:
        """The mean over blocks of their MoE load-balancing losses (of this forward)."""
        taken = [b.mlp.take_aux_loss() for b in self.blocks if isinstance(b.mlp, MoE)]
        aux = torch.stack([a for a in taken if a is not None]).mean()
        self.moe_aux_loss = aux.detach()
        return aux


def _local(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor as this rank's plain tensor (its backward hands the gradient back as
    the replicated DTensor's); any other tensor as it is."""
    return value.to_local() if isinstance(value, DTensor) else value
