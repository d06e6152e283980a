"""FP8 fine-tuning in Hugging Face's trainers: `transformers.Trainer` (causal LM), then TRL's
`DPOTrainer` with an FP8 policy and a frozen FP8 reference (`fp8lm.integrations.hf`).

A small Llama with a byte-level tokenizer (built here, no download) learns byte-level text of the
Python standard library in `Trainer` at O2, is saved with ``save_pretrained``, and is then tuned
with DPO on fp8lm's built-in preference pairs (true continuation of a source window chosen, a
corrupted one rejected): the policy at O2, the reference stored in E4M3.

    pip install 'fp8lm[hf]'
    python examples/trl_dpo.py --sft-steps 60 --dpo-steps 40
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

import fp8lm
from fp8lm.integrations.hf import fp8_optimizer, frozen_reference
from fp8lm.train.data import pack, stdlib_documents
from fp8lm.train.preference import builtin_pairs

SEQ_LEN = 96


def byte_tokenizer():
    """A GPT-2 style byte-level tokenizer with no merges: 256 byte tokens, then <eos> and <pad>."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte -> character map: printable bytes stand for themselves, the others for 256 + n.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    vocab = {chars[b]: b for b in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def small_llama(vocab_size: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(config)


def sft(model, tokenizer, tokens, steps: int, out: str) -> list[float]:
    """Causal-LM training in `transformers.Trainer` at O2; returns the logged losses."""
    import datasets
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    texts = [tokens[i : i + SEQ_LEN].tobytes().decode("utf-8", "replace") for i in range(0, 400 * SEQ_LEN, SEQ_LEN)]
    data = datasets.Dataset.from_dict({"text": texts}).map(
        lambda b: tokenizer(b["text"], truncation=True, max_length=SEQ_LEN), batched=True, remove_columns=["text"]
    )
    args = TrainingArguments(
        out,
        max_steps=steps,
        per_device_train_batch_size=8,
        logging_steps=10,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        lr_scheduler_type="cosine",
        warmup_steps=5,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        optimizers=(fp8_optimizer(model, "O2", lr=3e-3, weight_decay=0.1), None),
    )
    trainer.train()
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def dpo(policy, tokenizer, tokens, steps: int, out: str):
    """DPO in TRL's `DPOTrainer`: FP8 policy (O2), frozen E4M3 reference. Returns the trainer."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    def as_text(pairs):
        return {k: [getattr(p, k).decode("utf-8", "replace") for p in pairs] for k in ("prompt", "chosen", "rejected")}

    train = datasets.Dataset.from_dict(as_text(builtin_pairs(tokens, 512, 64, 32, seed=0)))
    held_out = datasets.Dataset.from_dict(as_text(builtin_pairs(tokens, 64, 64, 32, seed=1)))
    reference = frozen_reference(policy)
    optimizer = fp8_optimizer(policy, "O2", lr=5e-4)
    args = DPOConfig(
        out,
        max_steps=steps,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=16,
        beta=0.1,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=steps,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        max_length=SEQ_LEN + 16,
    )
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        processing_class=tokenizer,
        optimizers=(optimizer, None),
    )
    trainer.train()
    return trainer, reference, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--dpo-steps", type=int, default=40)
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        splits = pack(*stdlib_documents(), os.path.join(tmp, "cache"))
        model = small_llama(vocab_size=272)  # 258 tokens, padded to a multiple of 16 for the FP8 head
        losses = sft(model, tokenizer, splits.train, args.sft_steps, os.path.join(tmp, "sft"))
        print(f"Trainer, O2: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.sft_steps} steps")
        model.save_pretrained(os.path.join(tmp, "sft-model"))  # plain weights: the checkpoint loads anywhere
        policy = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "sft-model"))
        trainer, reference, optimizer = dpo(policy, tokenizer, splits.val, args.dpo_steps, os.path.join(tmp, "dpo"))
    last = [r for r in trainer.state.log_history if "eval_loss" in r][-1]
    print(
        f"DPOTrainer, O2 policy + E4M3 reference: held-out DPO loss {last['eval_loss']:.3f}, "
        f"reward accuracy {last['eval_rewards/accuracies']:.3f}, margin {last['eval_rewards/margins']:.3f}"
    )
    policy_bytes = fp8lm.memory_report(policy, optimizer)["bytes_per_param"]
    print(
        f"bytes per parameter: policy + optimizer {policy_bytes:.2f}, "
        f"reference {fp8lm.memory_report(reference)['bytes_per_param']:.2f}"
    )


if __name__ == "__main__":
    main()
