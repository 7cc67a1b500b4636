"""Every formula of GRPO as a small pure function on tensors (names follow verl).

Per-token tensors are flat [T] over the packed tokens of a micro-batch. Losses are sums of
`token_weights * per_token_loss`, where the weights already carry the normalisation by
*global* token / sequence counts, so the loss does not depend on DP size or micro-batching.
"""

from typing import NamedTuple

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, norm_adv_by_std: bool = True,
                     epsilon: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage per response: (r - mean_group) / (std_group + eps) (verl
    `compute_grpo_outcome_advantage`): groups are consecutive `group_size` responses of one prompt; std is
    unbiased; a group of one gets mean 0, std 1. `norm_adv_by_std=False` is Dr.GRPO (no std division)."""
    grouped = rewards.view(-1, group_size).float()
    if group_size == 1:
        mean, std = torch.zeros_like(grouped), torch.ones_like(grouped)
    else:
        mean, std = grouped.mean(-1, keepdim=True), grouped.std(-1, keepdim=True)
    centered = grouped - mean
    return (centered / (std + epsilon) if norm_adv_by_std else centered).view(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (verl `compute_rloo_outcome_advantage`): each reward minus the mean of its group's other rewards,
    (n r_i - sum_group) / (n - 1); a group of one keeps its reward."""
    grouped = rewards.view(-1, group_size).float()
    if group_size == 1:
        return grouped.view(-1)
    return ((group_size * grouped - grouped.sum(-1, keepdim=True)) / (group_size - 1)).view(-1)


def grpo_estimator(rewards: torch.Tensor, n: int, algo) -> torch.Tensor:
    """algorithm.adv_estimator=grpo: group_advantages with the algorithm section's settings."""
    return group_advantages(rewards, n, algo.norm_adv_by_std, algo.adv_epsilon)


def rloo_estimator(rewards: torch.Tensor, n: int, algo) -> torch.Tensor:
    """algorithm.adv_estimator=rloo: rloo_advantages (no settings of its own)."""
    return rloo_advantages(rewards, n)


# algorithm.adv_estimator, verl's names: (rewards [N], group size, algorithm section) -> advantages [N]. A plug-in
# module (config.algorithm_function) provides `advantages` of this signature and, optionally, its own `Settings`.
ADVANTAGE_ESTIMATORS = {"grpo": grpo_estimator, "rloo": rloo_estimator}


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer: int, factor: float):
    """DAPO's overlong reward shaping (verl `reward_model.overlong_buffer`), added to each reward: linear from 0 at
    max_response_length - buffer tokens to -factor at the limit: min(-(len - (max - buffer)) / buffer * factor, 0)."""
    return (-(response_lengths.float() - (max_response_length - buffer)) / buffer * factor).clamp(max=0.0)


def token_weights(response_lengths: torch.Tensor, mode: str, global_tokens: float, global_seqs: float,
                  max_response_length: int) -> torch.Tensor:
    """Weight of each response token in the aggregated loss, for verl's `loss_agg_mode`.

    token-mean: 1 / tokens; seq-mean-token-sum: 1 / seqs; seq-mean-token-mean: 1 / (len * seqs);
    seq-mean-token-sum-norm (Dr.GRPO): 1 / (seqs * max_response_length). Counts are global
    (all DP ranks, all micro-batches of the mini-batch). Returns per-response weights [S].
    """
    lengths = response_lengths.float()
    if mode == "token-mean":
        return torch.full_like(lengths, 1.0 / global_tokens)
    if mode == "seq-mean-token-sum":
        return torch.full_like(lengths, 1.0 / global_seqs)
    if mode == "seq-mean-token-mean":
        return 1.0 / (lengths.clamp(min=1) * global_seqs)
    if mode == "seq-mean-token-sum-norm":
        return torch.full_like(lengths, 1.0 / (global_seqs * max_response_length))
    raise ValueError(f"algorithm.loss_agg_mode={mode!r} is unknown")


class PolicyLoss(NamedTuple):
    """What a policy loss gives per token [T]: the loss, whether the ratio was clipped, whether the dual clip (the
    lower bound for negative advantages) acted, and the approximate KL to the old policy (-log ratio)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    clipped_lower: torch.Tensor
    approx_kl: torch.Tensor


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> PolicyLoss:
    """Per-token PPO clipped surrogate with dual clip (verl `compute_policy_loss_vanilla`)."""
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(-advantages * clip_ratio_c, loss_ppo)
    negative = advantages < 0
    loss = torch.where(negative, loss_dual, loss_ppo)
    clipped = loss_clipped > loss_unclipped
    clipped_lower = (loss_ppo > -advantages * clip_ratio_c) & negative
    return PolicyLoss(loss, clipped, clipped_lower, -log_ratio)


def gspo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                     lengths: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float) -> PolicyLoss:
    """GSPO (verl `compute_policy_loss_gspo`, arXiv 2507.18071): one ratio per response, the geometric mean of its
    tokens' ratios s = exp(mean log(pi / pi_old)), clipped to [1 - low, 1 + high], no dual clip; each token carries
    sg[s] pi_t / sg[pi_t] (its gradient is the token's own). `lengths` [S] split the flat tokens into responses."""
    log_ratio = logprobs - old_logprobs
    response = torch.repeat_interleave(torch.arange(len(lengths), device=logprobs.device), lengths.to(logprobs.device),
                                       output_size=len(logprobs))
    mean_log_ratio = log_ratio.detach().new_zeros(len(lengths)).index_add(0, response, log_ratio.detach())
    mean_log_ratio = mean_log_ratio / lengths.to(logprobs.device).clamp(min=1)
    ratio = torch.exp((logprobs - logprobs.detach() + mean_log_ratio[response]).clamp(max=10.0))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    no_dual_clip = torch.zeros_like(ratio, dtype=torch.bool)
    return PolicyLoss(torch.maximum(loss_unclipped, loss_clipped), loss_clipped > loss_unclipped, no_dual_clip,
                      -log_ratio)


def vanilla_loss(logprobs, old_logprobs, advantages, lengths, algo) -> PolicyLoss:
    """algorithm.loss_mode=vanilla: policy_loss with the algorithm section's clip ratios."""
    return policy_loss(logprobs, old_logprobs, advantages, algo.clip_ratio_low, algo.clip_ratio_high, algo.clip_ratio_c)


def gspo_loss(logprobs, old_logprobs, advantages, lengths, algo) -> PolicyLoss:
    """algorithm.loss_mode=gspo: gspo_policy_loss with the algorithm section's clip ratios."""
    return gspo_policy_loss(logprobs, old_logprobs, advantages, lengths, algo.clip_ratio_low, algo.clip_ratio_high)


# algorithm.loss_mode, verl's names: (logprobs, old logprobs, advantages [T], response lengths [S], algorithm section)
# -> PolicyLoss. A plug-in module (config.algorithm_function) provides `policy_loss` of this signature and,
# optionally, its own `Settings` (fields that join the --algorithm.* flags).
POLICY_LOSSES = {"vanilla": vanilla_loss, "gspo": gspo_loss}
LOSS_AGG_MODE_OF = {"gspo": "seq-mean-token-mean"}  # verl aggregates GSPO per response, whatever loss_agg_mode says


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate, verl's names: k1 / kl, abs, k2 / mse, k3 / low_var_kl
    (Schulman's, clamped to ±10). A "+" suffix (k3+, k1+, ...) keeps the value and takes k2's
    gradient, the unbiased one of KL (straight-through)."""
    log_ratio = logprobs - ref_logprobs
    base = kind.removesuffix("+")
    if base in ("k1", "kl"):
        value = log_ratio
    elif base == "abs":
        value = log_ratio.abs()
    elif base in ("k2", "mse"):
        value = 0.5 * log_ratio.square()
    elif base in ("k3", "low_var_kl"):
        neg = (-log_ratio).clamp(-20.0, 20.0)
        value = (torch.exp(neg) - neg - 1).clamp(-10.0, 10.0)
    else:
        raise ValueError(f"algorithm.kl_loss_type={kind!r} is unknown")
    if kind.endswith("+") and base not in ("k2", "mse"):
        k2 = 0.5 * log_ratio.square()
        return value.detach() + (k2 - k2.detach())
    return value


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Token-level truncated importance weights min(pi_old / pi_rollout, C), no gradient."""
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def rollout_mismatch(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token trainer-vs-sampler mismatch: |Δlogp| and the k3 KL estimate."""
    return {
        "abs_diff": (old_logprobs - rollout_logprobs).abs(),
        "k3": kl_penalty(old_logprobs, rollout_logprobs, "k3"),
    }


def grpo_token_loss(logprobs, old_logprobs, advantages, weights, algo, entropy=None, ref_logprobs=None,
                    rollout_logprobs=None, token_share: float | None = None, lengths: torch.Tensor | None = None,
                    policy=None):
    """The weighted GRPO loss of one micro-batch (a scalar) and its metrics.

    `weights` are per-token loss weights (they carry loss_agg_mode); `token_share` is 1 / the
    mini-batch's response tokens (default: token-mean weights); `lengths` [S] split the tokens into responses
    (GSPO needs them); `policy` is the policy loss (default: POLICY_LOSSES[algo.loss_mode]). Summed over every
    micro-batch and DP rank, the loss, pg_loss, entropy and kl_loss are aggregated like the loss (verl), while
    pg_clipfrac(_lower) and ppo_kl are token means under every mode.
    """
    pg, clipped, clipped_lower, approx_kl = (policy or POLICY_LOSSES[algo.loss_mode])(
        logprobs, old_logprobs, advantages, lengths, algo)
    if algo.tis_cap is not None and rollout_logprobs is not None:
        pg = pg * truncated_is_weights(old_logprobs, rollout_logprobs, algo.tis_cap)
    loss = (weights * pg).sum()
    share = weights if token_share is None else token_share
    metrics = {
        "actor/pg_loss": loss.detach(),
        "actor/pg_clipfrac": (share * clipped).sum(),
        "actor/pg_clipfrac_lower": (share * clipped_lower).sum(),
        "actor/ppo_kl": (share * approx_kl).sum().detach(),
    }
    if entropy is not None:
        entropy_mean = (weights * entropy).sum()
        metrics["actor/entropy"] = entropy_mean.detach()
        if algo.entropy_coeff:
            loss = loss - algo.entropy_coeff * entropy_mean
    if algo.use_kl_loss and ref_logprobs is not None:
        kl = (weights * kl_penalty(logprobs, ref_logprobs, algo.kl_loss_type)).sum()
        metrics["actor/kl_loss"] = kl.detach()
        loss = loss + algo.kl_loss_coef * kl
    return loss, metrics
