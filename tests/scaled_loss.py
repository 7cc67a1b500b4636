"""A policy-loss module outside the repo root, for the tests: PPO's clipped loss scaled by its own
`--algorithm.pg_scale` flag."""

from dataclasses import dataclass

import grpo


@dataclass
class Settings:
    pg_scale: float = 1.0  # what the vanilla per-token loss is multiplied by


def policy_loss(logprobs, old_logprobs, advantages, lengths, algo) -> grpo.PolicyLoss:
    """grpo.vanilla_loss with its loss times algo.pg_scale."""
    vanilla = grpo.vanilla_loss(logprobs, old_logprobs, advantages, lengths, algo)
    return vanilla._replace(loss=vanilla.loss * algo.pg_scale)
