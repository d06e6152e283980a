"""FP8 training of Hugging Face models with one call: `fp8lm.initialize`.

Builds GPT-2 (`GPT2LMHeadModel`, whose linear layers are `Conv1D`, a linear layer with a
transposed weight) and Llama (`LlamaForCausalLM`) from small configs, no weight download,
converts them with `fp8lm.initialize` and trains each a few steps on byte-level text of the Python
standard library, next to a BF16-autocast copy of the same model.

    pip install transformers
    python examples/hf_fp8.py --model gpt2 --opt-level O2 --steps 50
"""

from __future__ import annotations

import argparse
import copy
import tempfile

import torch

import fp8lm
from fp8lm.train.data import BatchSampler, pack, stdlib_documents

MODELS = ("gpt2", "llama")


def build(name: str, width: int = 128, layers: int = 2, seq_len: int = 128) -> torch.nn.Module:
    """A small model of the ``name`` architecture with a byte vocabulary, random weights."""
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=width, n_layer=layers, n_head=4)
        return transformers.GPT2LMHeadModel(config)
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=seq_len,
        )
        return transformers.LlamaForCausalLM(config)
    raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)}")


def train(model: torch.nn.Module, opt_level: str, steps: int, sampler: BatchSampler, lr: float = 1e-3):
    """``steps`` AdamW steps under bf16 autocast; ``opt_level`` "bf16" leaves the model as it is,
    "O1"/"O2" converts it first. Returns the losses and `fp8lm.memory_report` at the end."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    if opt_level != "bf16":
        model, optimizer = fp8lm.initialize(model, optimizer, opt_level=opt_level)
    device = next(model.parameters()).device
    losses = []
    for _ in range(steps):
        x = sampler.next()[0].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss  # HF shifts the labels itself
        loss.backward()
        fp8lm.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, fp8lm.memory_report(model, optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="gpt2")
    parser.add_argument("--opt-level", choices=("O1", "O2"), default="O2")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    base = build(args.model, seq_len=args.seq_len).to(args.device)
    with tempfile.TemporaryDirectory() as cache:
        splits = pack(*stdlib_documents(), cache)
        for level, model in (("bf16", copy.deepcopy(base)), (args.opt_level, base)):
            sampler = BatchSampler(splits.train, batch_size=8, seq_len=args.seq_len, seed=0)
            losses, report = train(model, level, args.steps, sampler)
            tail = sum(losses[-10:]) / len(losses[-10:])
            print(
                f"{args.model} {level}: loss {losses[0]:.3f} -> {tail:.3f} (mean of the last 10 steps), "
                f"{report['bytes_per_param']:.2f} bytes of training state per parameter"
            )


if __name__ == "__main__":
    main()
