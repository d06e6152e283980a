"""The run behind `fp8lm dpo`: DPO of a trained GPT against a frozen reference copy of it, as a
`~fp8lm.train.run.TrainingRun` whose batches are preference pairs and whose loss is DPO's.

The policy trains like `fp8lm train` at its level (bf16 autocast, ``fp8lm.initialize`` from O1,
FP8AdamW from O2); the reference is the starting checkpoint frozen: in E4M3 (`fp8lm.nn.freeze_fp8`,
about one byte per parameter) at the FP8 levels, in BF16 at ``bf16``. Everything else is the
training run's: ``metrics.jsonl``, atomic checkpoints, a bit-for-bit ``--resume``, ``summary.json``
written last. The reference's weights are written once next to the checkpoints
(``checkpoints/reference.pt``), so ``--resume`` needs no ``--init-from``. Under ``torchrun`` every
rank holds the reference and draws its share of each step's pairs; the policy's gradients are
synchronized as in ``fp8lm train`` (`FP8DataParallel` at O1/O2, FP8 ZeRO at O3, DDP at bf16).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import torch
from torch import nn

from ..memory import memory_report
from ..nn import freeze_fp8
from . import progress
from .checkpoint import CheckpointError, atomic_torch_save, checkpoint_weights, load_checkpoint
from .config import FP8_LEVELS, DPOConfig, RunError
from .data import is_packed, pack, run_documents
from .dpo_loss import DPOTerms, dpo_loss, sequence_logprobs, token_kl
from .hf_model import HFModelConfig, build_model
from .model import GPTConfig
from .preference import PairBatch, PairSampler, builtin_pairs, encode_pairs, read_pairs, split_pairs
from .ranks import barrier, mean_over_ranks
from .resume import check_state_fits, same_option
from .run import TrainingRun
from .tokenizer import recorded_tokenizer

__all__ = ["DPOConfig", "DPORun", "dpo", "finished_run", "SUMMARY_KEYS"]

# 1,024 held-out pairs: the reward accuracy's standard error is then about 0.01 (0.02 with 256)
BUILTIN_TRAIN_PAIRS, BUILTIN_HELD_OUT_PAIRS = 8192, 1024
SUMMARY_KEYS = (
    "dpo_loss",
    "reward_accuracy",
    "reward_margin",
    "kl_to_reference",
    "policy_bytes_per_param",
    "reference_bytes_per_param",
    "tokens_per_s",
)
REFERENCE_FILE = "reference.pt"
_RESUME_KEYS = ("beta", "batch_size", "lr", "seed", "data", "val_fraction")  # what makes the pairs and the loss


def _pretraining_corpus(state: dict) -> dict | None:
    """The corpus of the run that wrote checkpoint ``state`` (``RUN/checkpoints/step_N.pt``): its
    ``--data`` (None: the default corpus), its split and the folders that may hold its packed
    tokens (its ``--cache-dir``, else ``RUN/cache``): only read. None for a run trained on a Hugging
    Face dataset (not reused: the pairs come from the default corpus)."""
    options = state.get("options") or state.get("config") or {}
    if options.get("hf_dataset"):
        return None
    run = Path(state["path"]).resolve().parent.parent
    caches = [str(run / "cache")] + ([str(options["cache_dir"])] if options.get("cache_dir") else [])
    return {"data": options.get("data"), "val_fraction": options.get("val_fraction", 0.05), "caches": caches}


def _preferences(cfg: DPOConfig, mcfg: GPTConfig | HFModelConfig, out: Path, corpus: dict | None):
    """(training pairs, held-out pairs, description of the data). Without ``--data`` the built-in
    pairs come from the pretraining run's corpus (``corpus``; None: the default one), read from
    that run's packed tokens where they are (nothing copied), else packed under ``OUT/cache``."""
    if cfg.data:
        if Path(cfg.data).is_dir():
            raise RunError(f"--data {cfg.data!r} is a folder; fp8lm dpo reads a JSON Lines file of pairs")
        train, held_out = split_pairs(read_pairs(cfg.data), cfg.val_fraction)
        return train, held_out, {"source": f"jsonl:{Path(cfg.data).resolve()}"}
    origin = "the starting run's corpus" if corpus else "the default corpus"
    corpus = corpus or {"data": None, "val_fraction": 0.05, "caches": []}
    source, docs = run_documents(corpus["data"])
    shared = [c for c in corpus["caches"] if is_packed(source, docs, c, corpus["val_fraction"])]
    cache = cfg.cache_dir or (shared[0] if shared else out / "cache")
    splits = pack(source, docs, cache, corpus["val_fraction"])
    prompt, answer = mcfg.block_size // 2, mcfg.block_size // 4
    train = builtin_pairs(splits.train, BUILTIN_TRAIN_PAIRS, prompt, answer, seed=0)
    held_out = builtin_pairs(splits.val, BUILTIN_HELD_OUT_PAIRS, prompt, answer, seed=1)
    return (
        train,
        held_out,
        {
            "source": "builtin:" + splits.info["source"],
            "from": origin,
            "prompt_bytes": prompt,
            "answer_bytes": answer,
            "tokens_from": str(cache),
        },
    )


def _data_line(train: int, held_out: int, info: dict) -> str:
    """The data summary line of a DPO run: how many pairs, and where they come from."""
    line = f"data: {train:,} training and {held_out:,} held-out preference pairs"
    if not info["source"].startswith("builtin:"):
        return f"{line}, {info['source']}"
    return (
        f"{line} built from {info.get('from', 'the default corpus')} ({info['source'].removeprefix('builtin:')}): "
        f"a {info['prompt_bytes']}-byte prompt, its true next {info['answer_bytes']} bytes chosen, those bytes with "
        f"two changed rejected; tokens read from {info['tokens_from']}"
    )


def _reference(mcfg: GPTConfig | HFModelConfig, weights: dict, opt_level: str, device: torch.device) -> nn.Module:
    """The frozen reference: E4M3 at the FP8 levels, BF16 at bf16, FP32 at fp32."""
    model = build_model(mcfg)
    model.load_state_dict(weights)
    model.to(device)
    if opt_level in FP8_LEVELS:
        return freeze_fp8(model)
    if opt_level == "bf16":
        model.to(torch.bfloat16)
    return model.requires_grad_(False).eval()


class DPORun(TrainingRun):
    """A `TrainingRun` on preference pairs: batches are `PairBatch` es, the loss is DPO's against the
    frozen ``reference``, evaluation reports held-out DPO loss, reward accuracy, margin and KL."""

    cfg: DPOConfig
    NAME = "DPO"
    LOSS_NAMES = ("DPO loss", "held-out DPO loss")

    def __init__(self, cfg: DPOConfig) -> None:
        super().__init__(cfg)
        self._count_tokens()  # also when a resumed run has no step left to take

    def load_data(self) -> None:
        cfg, ranks, block_size = self.cfg, self.ranks, self.model_config.block_size
        if not ranks.main:
            barrier(ranks)  # rank 0 packs the built-in pairs' corpus; the others then read it
        weights, self.corpus, record = self._reference_weights()
        self.tokenizer = recorded_tokenizer(record)  # the pretraining run's
        self.encode = self.tokenizer.encoder() if self.tokenizer.json is not None else None
        self.train_pairs, self.held_out, self.data_info = _preferences(cfg, self.model_config, self.out, self.corpus)
        if ranks.main:
            barrier(ranks)
            progress.write_once(_data_line(len(self.train_pairs), len(self.held_out), self.data_info))
        self.sampler = PairSampler(
            self.train_pairs, cfg.batch_size // ranks.world, cfg.seed + ranks.rank, block_size, self.encode
        )
        self.val_batches = [encode_pairs(self.held_out[: cfg.batch_size], block_size, self.encode)]
        self.reference = _reference(self.model_config, weights, cfg.opt_level, self.device)
        self.reference_saved = False

    def _count_tokens(self) -> None:
        """Tokens per step as drawn so far (pairs differ in length): ``summary.json``'s ``tokens``
        and ``tokens_per_s`` are then the positions the policy computed, every rank's."""
        if self.sampler.batches_drawn:
            self.tokens_per_step = self.sampler.tokens_drawn * self.ranks.world / self.sampler.batches_drawn

    def _reference_weights(self) -> tuple[dict, dict | None, dict | None]:
        """The reference's weights, the pretraining run's corpus and tokenizer (as recorded): the
        starting checkpoint's, or, when resuming, those the run saved, read as any checkpoint is
        (regular file, plain data, finite, fitting the model)."""
        if not self.cfg.resume:
            state = load_checkpoint(self.cfg.init_from)
            return checkpoint_weights(state), _pretraining_corpus(state), state.get("tokenizer")
        saved = load_checkpoint(self.out / "checkpoints" / REFERENCE_FILE)
        config = saved.get("config")
        if not isinstance(config, dict) or any(key not in config for key in _RESUME_KEYS):
            raise CheckpointError(
                f"{saved['path']!r} is not the reference of an fp8lm dpo run (no options recorded); "
                "start a new run in another --out"
            )
        with torch.device("meta"):  # shapes only: nothing allocated
            check_state_fits(build_model(self.model_config), saved, repr(saved["path"]))
        for key in _RESUME_KEYS:
            if not same_option(key, config[key], getattr(self.cfg, key)):
                flag = "--" + key.replace("_", "-")
                raise CheckpointError(
                    f"the run in {str(self.out)!r} was trained with {flag} {config[key]}, "
                    f"not {getattr(self.cfg, key)}; resume with the same {flag}"
                )
        corpus = saved.get("corpus")
        return saved["model"], corpus if isinstance(corpus, dict) else None, saved.get("tokenizer")

    def next_batch(self) -> PairBatch:
        return self.sampler.next()

    def loss(self, model, batch: PairBatch) -> torch.Tensor:
        self.last_terms, _ = self._dpo_terms(model, batch.to(self.device))
        return self.last_terms.loss

    def _dpo_terms(self, model, batch: PairBatch):
        with self.autocast:
            logits = model(batch.inputs)[0]
            with torch.no_grad():
                ref_logits = self.reference(batch.inputs)[0]
        logps = sequence_logprobs(logits, batch.targets, batch.mask)
        ref_logps = sequence_logprobs(ref_logits, batch.targets, batch.mask)
        n = batch.pairs
        terms = dpo_loss(logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], self.cfg.beta)
        return terms, token_kl(logits.detach(), ref_logits, batch.mask)

    def batch_tokens(self, batch: PairBatch) -> int:
        return batch.inputs.numel()

    def step(self, step: int) -> dict:
        record = super().step(step)
        self._count_tokens()
        record["tokens"] = round(record["step"] * self.tokens_per_step)
        record["dpo_loss"] = record["train_loss"]  # the batch's DPO loss (all ranks'), under its own name too
        record["reward_accuracy"] = float(mean_over_ranks(self.last_terms.accuracy, self.ranks))
        record["reward_margin"] = float(mean_over_ranks(self.last_terms.margins.mean(), self.ranks))
        return record

    def _held_out_terms(self) -> Iterator[tuple[int, DPOTerms, torch.Tensor]]:
        """(pairs, DPO terms, KL per answer token) of each ``--batch-size`` chunk of the held-out
        pairs, in their order, the policy in eval mode meanwhile."""
        self.core.eval()
        try:
            for start in range(0, len(self.held_out), self.cfg.batch_size):
                chunk = self.held_out[start : start + self.cfg.batch_size]
                batch = encode_pairs(chunk, self.model_config.block_size, self.encode).to(self.device)
                yield (len(chunk), *self._dpo_terms(self.core, batch))
        finally:
            self.core.train()

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out pairs: DPO loss (as ``val_loss``), reward accuracy and margin, KL per answer token."""
        sums = dict.fromkeys(("val_loss", "val_reward_accuracy", "val_reward_margin", "val_kl_to_reference"), 0.0)
        for pairs, terms, kl in self._held_out_terms():
            sums["val_loss"] += float(terms.loss) * pairs
            sums["val_reward_accuracy"] += float(terms.accuracy) * pairs
            sums["val_reward_margin"] += float(terms.margins.sum())
            sums["val_kl_to_reference"] += float(kl) * pairs
        return {k: v / len(self.held_out) for k, v in sums.items()}

    @torch.no_grad()
    def held_out_rewards(self) -> DPOTerms:
        """Every held-out pair's implicit rewards under the policy as it is now, in the order of
        ``held_out``, computed as `evaluate` computes them; ``loss`` is the mean over the pairs.
        Per-pair outcomes, for comparing two runs pair by pair."""
        parts = list(self._held_out_terms())
        loss = sum(terms.loss * pairs for pairs, terms, _ in parts) / len(self.held_out)
        chosen = torch.cat([terms.chosen_rewards for _, terms, _ in parts])
        rejected = torch.cat([terms.rejected_rewards for _, terms, _ in parts])
        return DPOTerms(torch.as_tensor(loss), chosen, rejected)

    def save(self, step: int) -> None:
        if self.ranks.main and not self.reference_saved:  # before the first checkpoint, which then implies it
            config = {key: getattr(self.cfg, key) for key in _RESUME_KEYS}
            atomic_torch_save(
                {
                    "model": self.reference.state_dict(),
                    "config": config,
                    "corpus": self.corpus,
                    "tokenizer": self.tokenizer.record(),
                },
                self.out / "checkpoints" / REFERENCE_FILE,
            )
            self.reference_saved = True
        super().save(step)

    def summary(self) -> dict:
        summary = super().summary()
        final = self.logs.metrics.records[-1]
        reference = memory_report(self.reference)
        summary.update(
            {
                "tokens": round(summary["tokens"]),  # a mean per step times the steps: whole tokens
                "dpo_loss": final["val_loss"],  # held-out pairs, after the last step
                "reward_accuracy": final["val_reward_accuracy"],
                "reward_margin": final["val_reward_margin"],
                "kl_to_reference": final["val_kl_to_reference"],  # nats per answer token
                "policy_bytes_per_param": summary["bytes_per_param"],  # weights, gradients, optimizer state
                "reference_bytes_per_param": reference["bytes_per_param"],
                "total_bytes_per_param": summary["bytes_per_param"] + reference["bytes_per_param"],
                "reference_memory": reference,
                "beta": self.cfg.beta,
                "pairs": {"train": len(self.train_pairs), "held_out": len(self.held_out), **self.data_info},
            }
        )
        return summary


def dpo(cfg: DPOConfig) -> dict | None:
    """Run DPO as ``cfg`` says; returns the summary (also written to ``<out>/summary.json``, last).
    Everything that can be wrong with the inputs is checked before anything is written."""
    return DPORun(cfg).fit()


def finished_run(out: str | Path) -> DPORun:
    """The finished ``fp8lm dpo`` run in folder ``out``, reopened as it ended: the policy of its last
    checkpoint (weights and FP8 scaling state), its frozen reference and its held-out pairs, built
    as the run built them, with the configuration its ``summary.json`` records, in a process of as
    many ranks as the run had. Nothing is trained or written (but the corpus cache of the built-in
    pairs, if it is gone)."""
    summary_path = Path(out) / "summary.json"
    if not summary_path.is_file():
        raise RunError(f"{str(out)!r} holds no finished fp8lm dpo run (no summary.json); pass the --out of one")
    saved = json.loads(summary_path.read_text()).get("config", {})
    if "beta" not in saved:
        raise RunError(f"{str(summary_path)!r} is not the summary of an fp8lm dpo run; pass the --out of one")
    known = {f.name for f in fields(DPOConfig)}
    options = {key: value for key, value in saved.items() if key in known}
    # one step more than were taken: the resume check then accepts the finished run; none is taken
    options.update(out=str(out), resume=True, init_from=None, progress=False, steps=saved["steps"] + 1)
    run = DPORun(DPOConfig(**options))
    if run.lock is not None:  # nothing is written: the folder is free again at once
        run.lock.release()
        run.lock = None
    return run
