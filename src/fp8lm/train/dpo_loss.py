"""The DPO objective (Rafailov et al., 2023) as pure functions of logits and log-probabilities.

A batch holds each pair's chosen and rejected sequence (prompt + answer); ``mask`` marks the target
positions that are answer tokens, so the prompt (and padding) contributes nothing. With ``pi`` the
policy and ``ref`` the frozen reference, the implicit reward of an answer is
``beta * (log pi(y|x) - log ref(y|x))`` and the loss is ``-log sigmoid(reward_chosen - reward_rejected)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["sequence_logprobs", "implicit_rewards", "dpo_loss", "DPOTerms", "token_kl"]


def sequence_logprobs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``log p(target)`` over the positions where ``mask`` is true, per sequence.

    ``logits`` (batch, time, vocab) predict ``targets`` (batch, time); computed in float32 (or
    float64 for float64 logits) whatever the autocast dtype of the logits.
    """
    if logits.shape[:-1] != targets.shape or targets.shape != mask.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)}, targets {tuple(targets.shape)} and mask {tuple(mask.shape)} do not fit"
        )
    logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


def implicit_rewards(policy_logps: torch.Tensor, reference_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's implicit reward of each answer: ``beta * (log pi - log ref)``."""
    return beta * (policy_logps - reference_logps)


@dataclass
class DPOTerms:
    """The loss of a batch of pairs and what is logged about it (rewards are detached)."""

    loss: torch.Tensor  # mean over pairs, differentiable
    chosen_rewards: torch.Tensor  # (pairs,)
    rejected_rewards: torch.Tensor  # (pairs,)

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracy(self) -> torch.Tensor:
        """Share of pairs whose chosen answer has the higher reward (a tie counts as wrong)."""
        return (self.margins > 0).float().mean()


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float = 0.1,
) -> DPOTerms:
    """The DPO loss of pairs from the sequence log-probabilities (see `sequence_logprobs`) of their
    chosen and rejected answers under the policy and the reference."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen = implicit_rewards(policy_chosen, reference_chosen, beta)
    rejected = implicit_rewards(policy_rejected, reference_rejected, beta)
    loss = -F.logsigmoid(chosen - rejected).mean()
    return DPOTerms(loss, chosen.detach(), rejected.detach())


def token_kl(policy_logits: torch.Tensor, reference_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the masked positions of ``KL(pi || ref)`` between the next-token distributions
    (exact, over the whole vocabulary), in nats per token."""
    dtype = torch.promote_types(policy_logits.dtype, torch.float32)
    logp = policy_logits.to(dtype).log_softmax(-1)
    logr = reference_logits.to(dtype).log_softmax(-1)
    per_token = (logp.exp() * (logp - logr)).sum(-1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)
