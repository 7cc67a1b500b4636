"""grpo.py against float64 reference formulas written out here, element by element."""

import math
import os
from types import SimpleNamespace

import pytest
import torch

import grpo

torch.manual_seed(0)


def reference_advantages(rewards, group_size, norm, eps):
    out = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g:g + group_size]
        if group_size == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out += [(r - mean) / (std + eps) if norm else r - mean for r in group]
    return out


@pytest.mark.parametrize("group_size", [1, 2, 5])
@pytest.mark.parametrize("norm", [True, False])
def test_group_advantages(group_size, norm):
    rewards = [float(x) for x in torch.randint(0, 3, (4 * group_size,))]
    got = grpo.group_advantages(torch.tensor(rewards), group_size, norm, 1e-6)
    want = reference_advantages(rewards, group_size, norm, 1e-6)
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)


def test_all_equal_rewards_give_zero_advantage():
    assert torch.equal(grpo.group_advantages(torch.ones(6), 3), torch.zeros(6))


def reference_policy_loss(lp, old, adv, lo, hi, c):
    ratio = math.exp(max(min(lp - old, 20), -20))
    l1, l2 = -adv * ratio, -adv * min(max(ratio, 1 - lo), 1 + hi)
    ppo = max(l1, l2)
    return min(ppo, -adv * c) if adv < 0 else ppo


def test_policy_loss_with_dual_clip():
    lp, old = torch.randn(200, dtype=torch.float64), torch.randn(200, dtype=torch.float64)
    adv = torch.randn(200, dtype=torch.float64) * 2
    got, clipped, _, kl = grpo.policy_loss(lp, old, adv, 0.2, 0.28, 3.0)
    want = [reference_policy_loss(a, b, c, 0.2, 0.28, 3.0) for a, b, c in zip(lp.tolist(), old.tolist(), adv.tolist())]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(kl, old - lp)
    assert clipped.any() and not clipped.all()
    dual = adv < 0
    assert (got[dual] <= -adv[dual] * 3.0 + 1e-12).all()  # the dual clip binds somewhere
    assert any(g == pytest.approx(-a * 3.0) for g, a in zip(got[dual].tolist(), adv[dual].tolist()))


@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k2+", "mse+"])
def test_kl_penalty(kind):
    lp, ref = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    want = []
    for a, b in zip(lp.tolist(), ref.tolist()):
        if kind in ("k1", "kl"):
            want.append(a - b)
        elif kind == "abs":
            want.append(abs(a - b))
        elif kind.rstrip("+") in ("k2", "mse"):
            want.append(0.5 * (a - b) ** 2)
        else:
            want.append(min(max(math.exp(b - a) - (b - a) - 1, -10), 10))
    assert torch.allclose(grpo.kl_penalty(lp, ref, kind), torch.tensor(want, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+"])
def test_kl_penalty_straight_through_takes_k2_gradient(kind):
    """verl's "+" names: the value of the estimator, the gradient of k2 (d/dlp = lp - ref)."""
    lp = torch.randn(50, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(50, dtype=torch.float64)
    value = grpo.kl_penalty(lp, ref, kind)
    assert torch.allclose(value, grpo.kl_penalty(lp, ref, kind.rstrip("+")))
    value.sum().backward()
    assert torch.allclose(lp.grad, (lp - ref).detach())


def test_truncated_is_weights():
    old, rollout = torch.tensor([0.0, -1.0, -3.0]), torch.tensor([-1.0, -1.0, 0.0])
    got = grpo.truncated_is_weights(old, rollout, 2.0)
    assert torch.allclose(got, torch.tensor([2.0, 1.0, math.exp(-3.0)]))


def reference_agg(losses, mode, max_len):
    """verl's agg_loss on a padded [S, L] matrix, float64."""
    tokens = sum(len(x) for x in losses)
    if mode == "token-mean":
        return sum(sum(x) for x in losses) / tokens
    if mode == "seq-mean-token-sum":
        return sum(sum(x) for x in losses) / len(losses)
    if mode == "seq-mean-token-mean":
        return sum(sum(x) / len(x) for x in losses) / len(losses)
    return sum(sum(x) for x in losses) / (len(losses) * max_len)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_loss_aggregation_is_split_invariant(mode):
    """Any split into micro-batches / ranks, each weighted by global counts, sums to verl's value."""
    lengths = [3, 7, 1, 5, 4, 6]
    losses = [torch.randn(n, dtype=torch.float64).tolist() for n in lengths]
    want = reference_agg(losses, mode, max_len=8)
    tokens, seqs = float(sum(lengths)), float(len(lengths))
    total = 0.0
    for part in ([0, 1], [2], [3, 4, 5]):  # e.g. three micro-batches over two ranks
        weights = grpo.token_weights(torch.tensor([lengths[i] for i in part]), mode, tokens, seqs, 8)
        total += sum(w * sum(losses[i]) for w, i in zip(weights.tolist(), part))
    assert total == pytest.approx(want, rel=1e-6)


def test_grpo_token_loss_adds_kl_and_entropy():
    algo = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, tis_cap=None, loss_mode="vanilla",
                           entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1")
    lp, old, ref = torch.randn(6), torch.randn(6), torch.randn(6)
    adv, weights, entropy = torch.randn(6), torch.full((6,), 1 / 6), torch.rand(6)
    loss, metrics = grpo.grpo_token_loss(lp, old, adv, weights, algo, entropy, ref)
    pg = (weights * grpo.policy_loss(lp, old, adv, 0.2, 0.2, 3.0)[0]).sum()
    want = pg - 0.01 * (weights * entropy).sum() + 0.1 * (weights * (lp - ref)).sum()
    assert loss.item() == pytest.approx(want.item(), abs=1e-6)
    assert metrics["actor/pg_loss"].item() == pytest.approx(pg.item(), abs=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_clipfrac_and_ppo_kl_are_token_means_under_every_mode(mode):
    """Summed over micro-batches, pg_clipfrac is the fraction of clipped tokens and ppo_kl the token mean of
    old - new log-prob, whatever loss_agg_mode weights the loss with (float64 reference)."""
    algo = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, tis_cap=None,
                           entropy_coeff=0.0, use_kl_loss=False, loss_mode="vanilla")
    lengths = [3, 7, 1, 5]
    tokens, seqs = float(sum(lengths)), float(len(lengths))
    lp, old = torch.randn(int(tokens), dtype=torch.float64), torch.randn(int(tokens), dtype=torch.float64)
    adv = torch.randn(len(lengths), dtype=torch.float64).repeat_interleave(torch.tensor(lengths))
    clipped = grpo.policy_loss(lp, old, adv, 0.2, 0.2, 3.0)[1]
    totals, start = {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0}, 0
    for part in ([0, 1], [2, 3]):
        n = sum(lengths[i] for i in part)
        window = slice(start, start + n)
        weights = grpo.token_weights(torch.tensor([lengths[i] for i in part]), mode, tokens, seqs, 8)
        weights = weights.double().repeat_interleave(torch.tensor([lengths[i] for i in part]))
        _, metrics = grpo.grpo_token_loss(lp[window], old[window], adv[window], weights, algo, token_share=1 / tokens)
        for key in totals:
            totals[key] += metrics[key].item()
        start += n
    assert 0 < totals["actor/pg_clipfrac"] < 1
    assert totals["actor/pg_clipfrac"] == pytest.approx(clipped.double().mean().item(), rel=1e-12)
    assert totals["actor/ppo_kl"] == pytest.approx((old - lp).mean().item(), rel=1e-9)


def verl_gspo(lp, old, adv, mask, low, high):
    """verl's compute_policy_loss_gspo on a padded [S, L] batch, transcribed: (pg_loss, pg_clipfrac, ppo_kl)."""
    negative_approx_kl = lp - old
    seq_lengths = mask.sum(-1).clamp(min=1)
    negative_approx_kl_seq = (negative_approx_kl * mask).sum(-1) / seq_lengths
    log_seq_importance_ratio = (lp - lp.detach() + negative_approx_kl_seq.detach()[:, None]).clamp(max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -adv * seq_importance_ratio
    pg_losses2 = -adv * seq_importance_ratio.clamp(1 - low, 1 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_loss = ((pg_losses * mask).sum(-1) / seq_lengths).mean()  # agg_loss(..., "seq-mean-token-mean")
    clipfrac = ((pg_losses2 > pg_losses1).double() * mask).sum() / mask.sum()
    return pg_loss, clipfrac, (-negative_approx_kl * mask).sum() / mask.sum()


def test_gspo_equals_verls_formula_in_value_and_gradient():
    """The flat-token GSPO loss, with the seq-mean-token-mean weights it is aggregated by and split into two
    micro-batches, equals verl's padded-batch formula: loss, clip fraction, ppo_kl and the gradient (float64)."""
    lengths = [3, 7, 1, 5, 4]
    algo = SimpleNamespace(clip_ratio_low=3e-4, clip_ratio_high=4e-4, clip_ratio_c=3.0, tis_cap=None, loss_mode="gspo",
                           entropy_coeff=0.0, use_kl_loss=False)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    lp_padded = torch.randn(mask.shape, dtype=torch.float64) * 0.01 - 1.0
    offsets = torch.tensor([1e-3, -1e-3, 1e-4, 2e-3, -2e-3], dtype=torch.float64)[:, None]  # mean log-ratio per response
    old_padded = lp_padded - offsets + torch.randn(mask.shape, dtype=torch.float64) * 1e-5
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5], dtype=torch.float64)  # the first two clip, the rest do not
    lp_padded.requires_grad_(True)
    want, want_clipfrac, want_kl = verl_gspo(lp_padded, old_padded, adv[:, None], mask, 3e-4, 4e-4)
    want.backward()
    flat = [(i, t) for i, n in enumerate(lengths) for t in range(n)]
    lp = torch.tensor([lp_padded[i, t].item() for i, t in flat], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([old_padded[i, t].item() for i, t in flat], dtype=torch.float64)
    assert grpo.LOSS_AGG_MODE_OF["gspo"] == "seq-mean-token-mean"  # token_weights' own test covers that mode
    total, clipfrac, kl, start = 0.0, 0.0, 0.0, 0
    for part in ([0, 1], [2, 3, 4]):
        part_lengths = torch.tensor([lengths[i] for i in part])
        window = slice(start, start + int(part_lengths.sum()))
        weights = 1.0 / (part_lengths.double() * len(lengths))  # seq-mean-token-mean, in float64
        loss, metrics = grpo.grpo_token_loss(lp[window], old[window], adv[part].repeat_interleave(part_lengths),
                                             weights.repeat_interleave(part_lengths), algo,
                                             token_share=1 / sum(lengths), lengths=part_lengths)
        loss.backward()
        total, start = total + loss.item(), window.stop
        clipfrac += metrics["actor/pg_clipfrac"].item()
        kl += metrics["actor/ppo_kl"].item()
    assert 0 < want_clipfrac < 1
    assert total == pytest.approx(want.item(), rel=1e-12)
    assert clipfrac == pytest.approx(want_clipfrac.item(), rel=1e-6)  # the metric is summed in float32
    assert kl == pytest.approx(want_kl.item(), rel=1e-9)
    assert torch.allclose(lp.grad, torch.stack([lp_padded.grad[i, t] for i, t in flat]), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("group_size", [1, 2, 5])
def test_rloo_equals_verls_formula(group_size):
    """verl's compute_rloo_outcome_advantage: r * n / (n - 1) - mean * n / (n - 1); a group of one keeps r."""
    rewards = torch.randint(0, 3, (4 * group_size,)).double()
    want = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g:g + group_size].tolist()
        mean, n = (sum(group) / n if (n := len(group)) > 1 else 0.0), len(group)
        want += [r * n / (n - 1) - mean * n / (n - 1) if n > 1 else r for r in group]
    algo = SimpleNamespace(norm_adv_by_std=True, adv_epsilon=1e-6)
    got = grpo.ADVANTAGE_ESTIMATORS["rloo"](rewards, group_size, algo)
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)


def test_grpo_with_groups_of_one_keeps_the_reward():
    """verl's GRPO gives a group of one mean 0 and std 1: with rollout.n 1 the advantage is the reward itself."""
    algo = SimpleNamespace(norm_adv_by_std=True, adv_epsilon=1e-6)
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5])
    assert torch.allclose(grpo.ADVANTAGE_ESTIMATORS["grpo"](rewards, 1, algo), rewards / (1 + 1e-6))


def test_overlong_penalty_equals_dapos_reward_shaping():
    """verl's DAPO reward manager: exceed = len - (max - buffer); reward += min(-exceed / buffer * factor, 0)."""
    lengths, max_len, buffer, factor = torch.arange(0, 257), 256, 64, 1.5
    want = [min(-(n - (max_len - buffer)) / buffer * factor, 0.0) for n in lengths.tolist()]
    got = grpo.overlong_penalty(lengths, max_len, buffer, factor)
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert got[192].item() == 0.0 and got[256].item() == pytest.approx(-1.5)


def test_a_policy_loss_from_a_file_brings_its_own_setting():
    """--algorithm.loss_mode tests/scaled_loss.py adds that file's --algorithm.pg_scale; the loss the loop's
    grpo_token_loss computes with it is pg_scale times the vanilla loss (float64), its metrics otherwise the same."""
    from config import algorithm_function, parse_cli

    path = os.path.join(os.path.dirname(__file__), "scaled_loss.py")
    cfg = parse_cli(["--algorithm.loss_mode", path, "--algorithm.pg_scale", "2.5"])
    assert cfg.algorithm.pg_scale == 2.5 and cfg.algorithm.clip_ratio_c == 3.0
    g = torch.Generator().manual_seed(0)
    lp, old, adv = (torch.randn(12, generator=g, dtype=torch.float64) for _ in range(3))
    weights = torch.full((12,), 1 / 12, dtype=torch.float64)
    plugin = algorithm_function("algorithm.loss_mode", path)
    got, got_metrics = grpo.grpo_token_loss(lp, old, adv, weights, cfg.algorithm, policy=plugin)
    want, want_metrics = grpo.grpo_token_loss(lp, old, adv, weights, cfg.algorithm, policy=grpo.vanilla_loss)
    assert got.item() == pytest.approx(2.5 * want.item(), rel=1e-12) and want.abs().item() > 1e-3
    assert got_metrics["actor/pg_clipfrac"] == want_metrics["actor/pg_clipfrac"]


def test_dynamic_sampling_keeps_the_groups_whose_scores_differ():
    """DAPO's keep rule: groups of n consecutive scores; all equal is dropped, any spread kept; n = 1 keeps all."""
    from dapo import informative_groups

    assert informative_groups([1, 1, 0, 1, 0, 0, 0.5, 1], 2) == [1, 3]
    assert informative_groups([1, 1, 1, 0, 0, 0], 3) == []
    assert informative_groups([1, 0, 1], 1) == [0, 1, 2]
