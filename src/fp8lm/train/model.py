"""A nanoGPT-like decoder: pre-norm blocks, causal `scaled_dot_product_attention`, GELU or SwiGLU MLP.

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

__all__ = ["GPTConfig", "GPT", "PRESETS", "MLP_KINDS", "preset"]

MLP_KINDS = ("gelu", "swiglu")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    block_size: int = 128  # longest sequence the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp: str = "gelu"
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"unknown mlp {self.mlp!r}: use one of {', '.join(MLP_KINDS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

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


# Sizes: "tiny" for tests, "small" (the default) trains in about two minutes on two CPU cores,
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
    base = PRESETS[name].to_dict()
    base.update({k: v for k, v in overrides.items() if v is not None})
    return GPTConfig.from_dict(base)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        # Head count from c_attn's output: under tensor parallelism a rank holds only its heads.
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        heads = q.shape[-1] // self.head_dim
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        hidden = cfg.mlp_hidden
        # SwiGLU's gate and up projections are one GEMM (one FP8 layer), split afterwards.
        self.c_fc = nn.Linear(cfg.n_embd, 2 * hidden if self.swiglu else hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds the model's block_size {self.config.block_size}; "
                "use a shorter sequence or build the model with a larger block_size"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
