"""GRPO training loop: generate -> score -> group advantages -> old log-probs -> update -> weight sync.

    bash run.sh                                            # CPU demo, or GPU with defaults
    torchrun --nproc_per_node=4 loop.py --parallelism.data_parallel_shard_degree 2 \\
        --parallelism.tensor_parallel_degree 2 --model.path Qwen/Qwen3-0.6B

Settings: `--section.field value` flags (config.py). Read top-down: `train`, the run, `train_step` and its phases,
then the micro-batches that the log-prob pass and the update share."""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

import dapo
import grpo
import offpolicy
from config import Config, parse_cli
from engine import IGNORE_INDEX, ONE_PROCESS, TorchTitanEngineWithLMHead, pack, to_device
from metrics import MetricsLog, log, perf_metrics, quiet_known_noise, rollout_metrics
from plugins import algorithm_function, one_line_errors, sampler_class
from prompts import PromptSet, check_inputs, eos_token_ids
from rollout import Rollout, Sampler, build_rollout


def train(cfg: Config) -> dict[str, float]:
    """Run GRPO for trainer.total_training_steps; returns the last step's metrics."""
    start = time.perf_counter()
    run = build_run(cfg)
    metrics_log = MetricsLog(cfg, run.engine.loaded_step, run.task.VAL_METRIC)
    first = run.engine.loaded_step + 1
    if first > 1:
        log(f"resumed from step {run.engine.loaded_step}")
        run.groups.load(run.engine.checkpoint_folder(run.engine.loaded_step))
    if cfg.trainer.val_before_train and first == 1:
        metrics_log.write(0, run_validation(cfg, run))
    metrics, saved, exported = {}, None, None
    for step in range(first, cfg.trainer.total_training_steps + 1):
        metrics = train_step(cfg, step, run)
        last = step == cfg.trainer.total_training_steps
        if (cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0) or last:
            metrics.update(run_validation(cfg, run))
        metrics_log.write(step, metrics)  # before the checkpoint: a resume from it never lacks this row
        if cfg.checkpoint.save_freq > 0 and (step % cfg.checkpoint.save_freq == 0 or last):  # verl saves the last
            run.engine.save_checkpoint(step)
            saved = run.engine.checkpoint_folder(step)
            run.groups.save(saved)
    if cfg.checkpoint.export_hf and cfg.trainer.total_training_steps >= first:
        exported = run.engine.export_hf(cfg.trainer.total_training_steps)
    log(metrics_log.summary(time.perf_counter() - start, saved, exported))
    metrics_log.close()
    run.groups.close()
    dist.barrier()
    run.sampler.close()  # before the process group goes: vLLM's teardown frees its memory pools and groups
    return metrics


@dataclass
class Run:
    """What a GRPO run is made of: the actor, the optional KL reference, the task, prompts and sampler."""

    engine: TorchTitanEngineWithLMHead
    ref_engine: TorchTitanEngineWithLMHead | None
    task: object  # the data.task module
    tokenizer: object
    train_set: PromptSet
    val_set: PromptSet
    sampler: Sampler
    groups: OnPolicyGroups | offpolicy.OneStepOffPolicy | None = None  # where each step's groups come from


def build_run(cfg: Config) -> Run:
    """Check the inputs (check_inputs); then build the engine(s) and the sampler (synced)."""
    task, tokenizer, train_set, val_set = check_inputs(cfg)
    torch.manual_seed(cfg.trainer.seed)
    engine = TorchTitanEngineWithLMHead(cfg)
    ref_engine = TorchTitanEngineWithLMHead.reference(cfg) if cfg.algorithm.use_kl_loss else None
    sampler = build_rollout(cfg, engine, eos_token_ids(engine.model_dir, tokenizer))  # holds the trainer's weights
    run = Run(engine, ref_engine, task, tokenizer, train_set, val_set, sampler)
    if cfg.trainer.one_step_off_policy:
        run.groups = offpolicy.OneStepOffPolicy(lambda slot: local_groups(cfg, slot, run),
                                                lambda groups: share_within_model_parallel(engine, groups),
                                                cfg.trainer.total_training_steps)
    elif cfg.algorithm.filter_groups:
        run.groups = OnPolicyGroups(dapo.DynamicSampling(cfg, engine, slot_groups(cfg, run)), sampler)
    else:
        draw = slot_groups(cfg, run)
        run.groups = OnPolicyGroups(lambda step: (*draw(step), {}), sampler)
    return run


def train_step(cfg: Config, step: int, run: Run) -> dict[str, float]:
    """One GRPO step: generate -> score -> group advantages -> old log-probs -> update -> weight sync. The step's
    groups come from run.groups (generated now, or one step ahead by the one-step off-policy mode)."""
    engine, sampler, a = run.engine, run.sampler, cfg.algorithm
    timings, t0 = {}, time.perf_counter()
    rollout, rewards, metrics = run.groups.take(step)
    timings["gen"] = time.perf_counter() - t0

    if a.overlong_buffer_len:
        lengths = torch.tensor([len(r) for r in rollout.response_ids])
        penalty = grpo.overlong_penalty(lengths, cfg.data.max_response_length, a.overlong_buffer_len,
                                        a.overlong_penalty_factor)
        rewards = (torch.tensor(rewards) + penalty).tolist()
    estimator = algorithm_function("algorithm.adv_estimator", a.adv_estimator)
    advantages = estimator(torch.tensor(rewards), cfg.rollout.n, a).tolist()
    samples = [Sample(prompt, response, logprobs, advantage) for prompt, response, logprobs, advantage in
               zip(rollout.prompt_ids, rollout.response_ids, rollout.logprobs, advantages)]

    t = time.perf_counter()
    compute_old_and_ref_logprobs(cfg, engine, run.ref_engine, samples)
    timings["old_log_prob"] = time.perf_counter() - t

    t = time.perf_counter()
    metrics.update(update_actor(cfg, engine, samples))
    timings["update_actor"] = time.perf_counter() - t

    timings.update(run.groups.update_done())  # groups drawn ahead must be finished before vLLM takes new weights
    timings["update_weights"] = sampler.sync_weights()
    timings["step"] = time.perf_counter() - t0
    metrics.update(rollout_metrics(engine, samples, rollout, rewards))
    metrics.update({f"timing_s/{k}": v for k, v in timings.items()})
    metrics.update(perf_metrics(engine, samples, timings))
    return metrics


# ----------------------------------------------------------------------------- the phases of a step
class OnPolicyGroups:
    """A step's groups generated at its start from the current weights by `draw(step)` (prompt slot `step`, or
    dapo.DynamicSampling's slots); vLLM then sleeps until the sync (with rollout.free_cache_engine) so that its
    memory serves the update."""

    def __init__(self, draw: Callable, sampler: Sampler):
        self.draw, self.sampler = draw, sampler

    def take(self, step: int) -> tuple[Rollout, list[float], dict[str, float]]:
        """This rank's share of the step's groups, their scores and metrics."""
        groups = self.draw(step)
        self.sampler.sleep()
        return groups

    def update_done(self) -> dict[str, float]:
        """Nothing runs beside the update: no timings to add."""
        return {}

    def save(self, folder: str) -> None:
        pass

    def load(self, folder: str) -> None:
        pass

    def close(self) -> None:
        pass


def slot_groups(cfg: Config, run: Run) -> Callable:
    """draw(slot): the groups of a prompt slot and their scores, shared with the model-parallel peers."""
    return lambda slot: share_within_model_parallel(run.engine, local_groups(cfg, slot, run))


def local_groups(cfg: Config, slot: int, run: Run) -> tuple[Rollout, list[float]]:
    """This rank's prompts of a prompt slot, n responses each and their task scores (no collective: it may run
    beside the update)."""
    prompts = run.train_set.batch(slot, cfg.data.train_batch_size)[run.engine.dp_rank::run.engine.dp_size]
    rollout = run.sampler.generate([ids for ids, _ in prompts], cfg.rollout.n, seed=step_seed(cfg, slot, run.engine),
                                   logprob_samples=rollout_logprob_samples(cfg))
    return rollout, score(cfg, run, rollout.response_ids, [truth for _, truth in prompts for _ in range(cfg.rollout.n)])


def score(cfg: Config, run: Run, response_ids: list[list[int]], truths: list[str]) -> list[float]:
    """The task's reward of each decoded response (the task's `--reward.*` settings as keywords)."""
    texts = run.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return [run.task.score(text, truth, **vars(cfg.reward)) for text, truth in zip(texts, truths)]


def step_seed(cfg: Config, step: int, engine) -> int:
    """Sampling seed of a step on a DP rank: reproducible across resume, distinct across ranks (coprime
    offsets: two (step, rank) pairs share a seed only with 1009 or more DP ranks)."""
    return cfg.rollout.seed * 1_000_003 + step * 1009 + engine.dp_rank * 17


def share_within_model_parallel(engine, data):
    """TP and CP peers train on the same data: take the first peer's (a rollout, or groups with their scores)."""
    for name in ("tp", "cp"):
        mesh = engine.parallel_dims.get_optional_mesh(name)
        if mesh is not None and mesh.size() > 1:
            box = [data]
            dist.broadcast_object_list(box, group_src=0, group=mesh.get_group())
            data = box[0]
    return data


def on_policy(cfg) -> bool:
    """One update per batch from fresh samples: the old log-probs are the current ones (the loss takes
    current.detach())."""
    one_update = cfg.actor.ppo_epochs == 1 and cfg.data.train_batch_size == cfg.actor.ppo_mini_batch_size
    return one_update and not cfg.trainer.one_step_off_policy


def rollout_logprob_samples(cfg) -> int:
    """How many of each prompt's n responses need the sampler's log-probs: all where the loss uses them or the
    samples are a step old (one-step off-policy), the first one for the mismatch metric (enough for a mean, and
    vLLM's host-side cost of returning them grows with the responses that ask), none on-policy, where that metric
    has no old log-probs."""
    if cfg.actor.use_rollout_logprobs or cfg.algorithm.tis_cap is not None or cfg.trainer.one_step_off_policy:
        return cfg.rollout.n
    return 0 if on_policy(cfg) else 1


def compute_old_and_ref_logprobs(cfg, engine, ref_engine, samples) -> None:
    """Old log-probs (unless on-policy or taken from the rollout) and reference log-probs."""
    if cfg.actor.use_rollout_logprobs:
        for s in samples:
            s.old_logprobs = torch.tensor(s.rollout_logprobs)
    elif not on_policy(cfg) or cfg.algorithm.tis_cap is not None:
        for s, lp in zip(samples, compute_logprobs(engine, samples, cfg.rollout.temperature)):
            s.old_logprobs = lp
    if ref_engine is not None:
        for s, lp in zip(samples, compute_logprobs(ref_engine, samples, cfg.rollout.temperature)):
            s.ref_logprobs = lp


def update_actor(cfg, engine, samples) -> dict[str, float]:
    """ppo_epochs x mini-batches of forward_backward_batch + optimizer and LR steps."""
    per_rank_prompts = cfg.actor.ppo_mini_batch_size // engine.dp_size
    mini_batch = per_rank_prompts * cfg.rollout.n
    totals, steps = defaultdict(float), 0
    with engine.train_mode():
        for _ in range(cfg.actor.ppo_epochs):
            for start in range(0, len(samples), mini_batch):
                chunk = samples[start:start + mini_batch]
                tokens = float(sum(len(s.response_ids) for s in chunk))
                counts = engine.dp_all_reduce(torch.tensor([tokens, len(chunk)]))
                loss_fn = grpo_loss_fn(cfg, max(counts[0].item(), 1.0), max(counts[1].item(), 1.0))
                metrics = forward_backward_batch(engine, chunk, loss_fn, cfg.rollout.temperature)
                metrics = dict(zip(metrics, engine.dp_all_reduce(torch.tensor(list(metrics.values()))).tolist()))
                grad_norm, stepped = engine.optimizer_step()
                metrics["actor/grad_norm"] = grad_norm
                metrics["actor/skipped_steps"] = 0.0 if stepped else 1.0
                metrics["actor/lr"] = engine.lr_scheduler_step()
                for key, value in metrics.items():
                    totals[key] += value
                steps += 1
    result = {k: v / steps for k, v in totals.items()}
    result["actor/skipped_steps"] = totals["actor/skipped_steps"] if steps else 1.0  # no samples: no update
    return result


def run_validation(cfg: Config, run: Run) -> dict[str, float]:
    """Greedy mean@1 reward on the validation prompts, with a progress line per chunk."""
    engine, items = run.engine, run.val_set.items
    items = items[: cfg.data.max_val_samples] if cfg.data.max_val_samples > 0 else items
    per_rank = -(-len(items) // engine.dp_size)
    mine = items[engine.dp_rank::engine.dp_size]
    padded = mine + [items[0]] * (per_rank - len(mine))  # every rank runs the same generate calls (lockstep)
    total = 0.0
    for start in range(0, per_rank, cfg.data.val_batch_size):
        chunk = padded[start:start + cfg.data.val_batch_size]
        rollout = run.sampler.generate([ids for ids, _ in chunk], 1, greedy=True, logprob_samples=0)
        rollout = share_within_model_parallel(engine, rollout)  # TP / CP peers score their first peer's
        scores = score(cfg, run, rollout.response_ids, [truth for _, truth in chunk])
        total += sum(scores[:max(len(mine) - start, 0)])  # padding does not count
        log(f"validation: {min((start + len(chunk)) * engine.dp_size, len(items))}/{len(items)} prompts")
    summed = engine.dp_all_reduce(torch.tensor([total, float(len(mine))], dtype=torch.float64)).tolist()
    return {run.task.VAL_METRIC: summed[0] / max(summed[1], 1.0)}


# ----------------------------------------------------------------------------- micro-batches
@dataclass
class Sample:
    """One prompt + response, with everything the update needs."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float] | None  # the sampler's; None where not asked for (rollout_logprob_samples)
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None  # [response length]
    ref_logprobs: torch.Tensor | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def response_slice(self) -> slice:
        """The positions that predict the response tokens (each position predicts the next token)."""
        return slice(len(self.prompt_ids) - 1, len(self.prompt_ids) - 1 + len(self.response_ids))

    def labels(self) -> torch.Tensor:
        """Next-token labels on the positions that predict response tokens, IGNORE elsewhere."""
        labels = torch.full((len(self.tokens),), IGNORE_INDEX)
        labels[self.response_slice()] = torch.tensor(self.response_ids, dtype=torch.long)
        return labels


def pack_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most max_tokens tokens (in order)."""
    groups, current, used = [], [], 0
    for index, length in enumerate(lengths):
        if current and used + length > max_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        groups.append(current)
    return groups


PADDING = Sample([0, 0], [], [])  # what a DP rank with fewer micro-batches runs: two tokens, no response


def micro_batches(engine, samples: list[Sample]) -> Iterator[tuple[list[int], list[Sample]]]:
    """(sample indices, members) of packed micro-batches; as many on every DP rank, since FSDP runs its
    collectives in lockstep: a rank with fewer gets padding micro-batches (no indices, PADDING as member)."""
    groups = pack_micro_batches([len(s.tokens) for s in samples], engine.cfg.actor.max_tokens_per_micro_batch)
    count = int(engine.dp_all_reduce(torch.tensor([float(len(groups))]), dist.ReduceOp.MAX).item())
    for group in groups + [[] for _ in range(count - len(groups))]:
        yield group, [samples[i] for i in group] or [PADDING]


def forward_micro_batch(engine, members: list[Sample], temperature: float, with_entropy: bool):
    """One packed forward; returns (logprobs [T], entropy [T] or None, each member's response window)."""
    tokens, positions = pack([s.tokens for s in members])
    labels = torch.cat([s.labels() for s in members])[None]
    logprobs, entropy = engine.forward(tokens, positions, labels, temperature, with_entropy)
    starts = torch.tensor([0] + [len(s.tokens) for s in members]).cumsum(0).tolist()
    windows = [slice(start + s.response_slice().start, start + s.response_slice().stop)
               for start, s in zip(starts, members)]
    return logprobs, entropy, windows


def compute_logprobs(engine, samples: list[Sample], temperature: float) -> list[torch.Tensor]:
    """Each sample's response-token log-probs (on the host), without autograd: old and reference log-probs."""
    out = [None] * len(samples)
    with engine.eval_mode():
        for group, members in micro_batches(engine, samples):
            logprobs, _, windows = forward_micro_batch(engine, members, temperature, with_entropy=False)
            host = logprobs.cpu()  # one device -> host copy per micro-batch
            for i, window in zip(group, windows):
                out[i] = host[window]
    return out


def forward_backward_batch(engine, samples: list[Sample], loss_fn, temperature: float) -> dict[str, float]:
    """Forward and backward every micro-batch (gradients accumulate); returns the metrics summed over them.
    `loss_fn(members, logprobs_per_member, entropy_per_member)` -> (loss, metrics), both normalised by the
    mini-batch's global counts, so the micro-batching does not change the result."""
    metrics = defaultdict(float)
    for group, members in micro_batches(engine, samples):
        logprobs, entropy, windows = forward_micro_batch(engine, members, temperature, with_entropy=True)
        if not group:  # padding: a zero loss that still runs FSDP's backward collectives
            engine.backward((logprobs * 0.0).sum())
            continue
        loss, micro_metrics = loss_fn(members, [logprobs[w] for w in windows], [entropy[w] for w in windows])
        engine.backward(loss)
        for key, value in micro_metrics.items():
            metrics[key] += value.detach()  # stays on the device until the end
    return {key: float(value) for key, value in metrics.items()}


def grpo_loss_fn(cfg: Config, global_tokens: float, global_seqs: float):
    """The GRPO loss over a micro-batch, normalised by the mini-batch's global counts."""
    policy = algorithm_function("algorithm.loss_mode", cfg.algorithm.loss_mode)

    def loss_fn(members, logprobs, entropies):
        lengths = torch.tensor([len(s.response_ids) for s in members])
        mode = grpo.LOSS_AGG_MODE_OF.get(cfg.algorithm.loss_mode, cfg.algorithm.loss_agg_mode)
        per_seq = grpo.token_weights(lengths, mode, global_tokens, global_seqs, cfg.data.max_response_length)
        current = torch.cat(logprobs)
        host = {  # per response token, built on the host and copied to the device at once
            "weights": per_seq.float().repeat_interleave(lengths),
            "advantages": torch.tensor([s.advantage for s in members]).float().repeat_interleave(lengths),
        }
        if cfg.algorithm.tis_cap is not None:
            host["rollout"] = torch.cat([torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in members])
        if members[0].old_logprobs is not None:
            host["old"] = torch.cat([s.old_logprobs for s in members])
        if members[0].ref_logprobs is not None:
            host["ref"] = torch.cat([s.ref_logprobs for s in members])
        on_device = dict(zip(host, to_device(torch.stack(list(host.values())), current.device)))
        old = on_device.get("old", current.detach())  # on-policy (one update per batch): old == current
        return grpo.grpo_token_loss(current, old, on_device["advantages"], on_device["weights"], cfg.algorithm,
                                    torch.cat(entropies), on_device.get("ref"), on_device.get("rollout"),
                                    token_share=1.0 / global_tokens, lengths=lengths, policy=policy)

    return loss_fn


# ----------------------------------------------------------------------------- reference and entry point
def main(argv: list[str]) -> None:
    """Train with the settings in argv (`--check` first: only check_inputs, as run.sh does before it starts several
    processes); a bad input ends the process with one line on stderr and exit code 2."""
    quiet_known_noise()
    os.environ.update({**ONE_PROCESS, **os.environ})  # without torchrun: one process
    check_only = argv[:1] == ["--check"]
    with one_line_errors():
        cfg = parse_cli(argv[check_only:])
        os.environ.update(sampler_class(cfg).environment)  # before the sampler's package is imported
        if check_only:
            check_inputs(cfg)
        else:
            train(cfg)
    if dist.is_initialized():  # vLLM's shutdown has already destroyed it
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
