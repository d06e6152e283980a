"""Worker for tests/test_fsdp_compile.py: FSDP2 with each block compiled, as torchtitan-style
trainers run it (``fully_shard`` on each block and the root, ``block.compile(fullgraph=True)``),
under every recipe at O1 and O2 (gloo ranks). For each it trains a small pre-norm transformer
twice from the same weights on the same batches, once with the blocks compiled and once eager,
and returns both runs' losses and gradient norms, or the error the compiled run stopped with.

The backend is ``aot_eager_decomp_partition``: dynamo, AOTAutograd's decompositions and its
min-cut partitioner, which decides (as inductor's does) what the forward saves for the
backward, without generating code."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

from dist_launch import worker_main

RECIPES = ("tensorwise-delayed", "rowwise", "rowwise-wgrad-bf16", "blockwise", "mxfp8", "nvfp4")
LEVELS = ("O2", "O1")
# On 2 ranks the MLP's (512, 128) weights shard into whole 128 x 128 blocks and travel as the
# recipe's operand; the attention's (128, 128) ones do not (64 rows each) and travel in their
# stored format, quantized after the gather.
WIDTH, HEADS, VOCAB, LAYERS = 128, 4, 256, 2
BATCH, SEQ, STEPS, LR = 2, 32, 3, 1e-3
BACKEND = "aot_eager_decomp_partition"


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, 4 * d, bias=False), nn.Linear(d, 4 * d, bias=False)
        self.w2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (m(h).view(b, t, HEADS, d // HEADS).transpose(1, 2) for m in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(LAYERS))
        self.norm = nn.RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train(recipe: str, level: str, rank: int, compiled: bool) -> dict:
    """``STEPS`` steps of the sharded model; the losses and gradient norms of each."""
    import fp8lm
    from fp8lm.distributed import fully_shard, precompute_fp8_scales

    torch.manual_seed(0)
    model, _ = fp8lm.initialize(Model(), opt_level=level, recipe=recipe)
    for block in model.blocks:
        if compiled:
            block.compile(fullgraph=True, backend=BACKEND)
        fully_shard(block)
    fully_shard(model)
    params = model.parameters()
    optimizer = fp8lm.optim.FP8AdamW(params, lr=LR) if level == "O2" else torch.optim.AdamW(params, lr=LR)
    data = torch.Generator().manual_seed(100 + rank)
    losses, norms = [], []
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=data)
        torch.manual_seed(1000 * step + rank)  # nvfp4's stochastic rounding: the same draws in both runs
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        norms.append(float(fp8lm.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        precompute_fp8_scales(model)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def checks(rank, world):
    res = {}
    for level in LEVELS:
        for recipe in RECIPES:
            torch._dynamo.reset()
            try:
                compiled = train(recipe, level, rank, compiled=True)
            except Exception as error:  # reported per recipe: one failure does not hide the others
                compiled = {"error": f"{type(error).__name__}: {str(error)[:600]}"}
            res[level, recipe] = {"compiled": compiled, "eager": train(recipe, level, rank, compiled=False)}
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    worker_main(checks)
