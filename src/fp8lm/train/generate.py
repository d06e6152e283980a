"""``fp8lm generate``: continue a prompt with a model, greedily or by sampling, from an exported
Hugging Face folder (read by ``transformers``) or a training run (fp8lm's own model of its
checkpoint, as the run evaluates it).

One decoding loop serves both: `generate_ids` asks a ``next_logits(ids)`` function for the
logits of the next token, the context cropped on the left to the model's length.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..export import ExportError, require_hf
from .export import read_run_checkpoint, run_autocast, run_model, run_tokenizer

__all__ = ["Generator", "load_generator", "generate_ids", "next_token", "is_exported_folder"]


@dataclass
class Generator:
    """What decoding needs of a model: the next-token logits of a sequence of ids (1-D float32),
    the longest context it reads, and its tokenizer's ``encode``/``decode``."""

    next_logits: Callable[[torch.Tensor], torch.Tensor]
    context: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    """The next id: the most likely one when ``temperature`` is 0 (greedy), else one drawn from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely (all when None)."""
    if temperature == 0:
        return int(logits.argmax())
    scaled = logits.double() / temperature
    if top_k is not None and top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator))


def generate_ids(
    model: Generator,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
) -> list[int]:
    """``max_new_tokens`` ids continuing ``prompt``; the model reads at most its context."""
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            window = torch.tensor(ids[-model.context :], dtype=torch.long)
            ids.append(next_token(model.next_logits(window), temperature, top_k, generator))
    return ids[len(prompt) :]


def is_exported_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face model folder (holds ``config.json``)."""
    return (Path(path) / "config.json").is_file()


def load_generator(path: str | os.PathLike, step: int | None = None) -> Generator:
    """The `Generator` of an exported folder (``transformers``) or of a run's checkpoint (fp8lm)."""
    if is_exported_folder(path):
        if step is not None:
            raise ExportError(f"--step picks a checkpoint of a run; {str(path)!r} is an exported folder")
        return _hf_generator(Path(path))
    return _run_generator(path, step)


def _hf_generator(folder: Path) -> Generator:
    require_hf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = model.config
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or 2048

    def next_logits(ids: torch.Tensor) -> torch.Tensor:
        return model(ids[None]).logits[0, -1].float()

    return Generator(
        next_logits,
        int(context),
        lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
        lambda ids: tokenizer.decode(ids),
    )


def _run_generator(path: str | os.PathLike, step: int | None) -> Generator:
    state = read_run_checkpoint(path, step)
    model = run_model(state)
    autocast = run_autocast(state)
    tokenizer = run_tokenizer(state)

    def next_logits(ids: torch.Tensor) -> torch.Tensor:
        with autocast:  # the padded ids of the vocabulary stand for no text: never chosen
            return model(ids[None])[0][0, -1, : tokenizer.vocab].float()

    return Generator(
        next_logits,
        state["model_config"].block_size,
        lambda text: tokenizer.encode(text.encode("utf-8")),
        tokenizer.decode,
    )
