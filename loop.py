"""GRPO training loop: generate -> score -> group advantages -> old log-probs -> update -> weight sync.

    bash run.sh                                            # CPU demo, or GPU with defaults
    torchrun --nproc_per_node=4 loop.py --parallelism.data_parallel_shard_degree 2 \\
        --parallelism.tensor_parallel_degree 2 --model.path Qwen/Qwen3-0.6B

Every setting is a `--section.field value` flag of config.py.
"""

import copy
import fcntl
import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torchtitan.tools.utils import get_peak_flops
from transformers import AutoTokenizer

import gsm8k
import grpo
from config import Config, parse_cli, validate
from engine import IGNORE_INDEX, TorchTitanEngineWithLMHead, load_model_dir, pack, to_device
from rollout import Rollout, build_rollout


# ----------------------------------------------------------------------------- data


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


class PromptSet:
    """Tokenized chat prompts; over-long ones dropped (and counted), never truncated."""

    def __init__(self, problems: list[dict], tokenizer, cfg: Config, name: str):
        self.items, dropped = [], 0
        for problem in problems:
            ids = tokenizer.apply_chat_template(
                gsm8k.build_prompt(problem["question"]), add_generation_prompt=True, tokenize=True,
                enable_thinking=cfg.data.enable_thinking,
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            if len(ids) > cfg.data.max_prompt_length:
                dropped += 1
                continue
            self.items.append((ids, problem["ground_truth"]))
        if not self.items:
            raise ValueError(f"data: every {name} prompt is longer than data.max_prompt_length; raise it")
        log(f"{name}: {len(self.items)} prompts, {dropped} dropped as longer than {cfg.data.max_prompt_length} tokens")
        self.seed = cfg.data.seed

    def batch(self, step: int, size: int) -> list[tuple[list[int], str]]:
        """Prompts of a 1-based step: a fixed function of step, so resuming continues the order."""
        per_epoch, batch = len(self.items), []
        for index in range((step - 1) * size, step * size):
            epoch, offset = divmod(index, per_epoch)
            order = torch.randperm(per_epoch, generator=torch.Generator().manual_seed(self.seed + epoch))
            batch.append(self.items[order[offset]])
        return batch


# ----------------------------------------------------------------------------- micro-batches


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
    """Forward and backward every micro-batch; gradients accumulate (no optimizer step).

    `loss_fn(members, logprobs_per_member, entropy_per_member)` returns (loss, metrics), both already
    normalised by the mini-batch's global counts, so the micro-batching does not change the result.
    Returns the metrics summed over micro-batches.
    """
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

    def loss_fn(members, logprobs, entropies):
        lengths = torch.tensor([len(s.response_ids) for s in members])
        per_seq = grpo.token_weights(lengths, cfg.algorithm.loss_agg_mode, global_tokens, global_seqs,
                                     cfg.data.max_response_length)
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
                                    token_share=1.0 / global_tokens)

    return loss_fn


# ----------------------------------------------------------------------------- one step


def generate(sampler, engine, prompts: list[list[int]], n: int, greedy: bool = False, seed: int = 0,
             logprob_samples: int | None = None) -> Rollout:
    """n responses per prompt from the sampler; TP / CP peers all get their first peer's (they train on it)."""
    rollout = sampler.generate(prompts, n, greedy=greedy, seed=seed, logprob_samples=logprob_samples)
    return share_within_model_parallel(engine, rollout)


def score(cfg, tokenizer, response_ids: list[list[int]], truths: list[str]) -> list[float]:
    """The task's reward of each decoded response."""
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return [gsm8k.score(text, truth, cfg.reward.method, cfg.reward.format_score, cfg.reward.correct_score)
            for text, truth in zip(texts, truths)]


def step_seed(cfg: Config, step: int, engine) -> int:
    """Sampling seed of a step on a DP rank: reproducible across resume, distinct across ranks (coprime
    offsets: two (step, rank) pairs share a seed only with 1009 or more DP ranks)."""
    return cfg.rollout.seed * 1_000_003 + step * 1009 + engine.dp_rank * 17


def share_within_model_parallel(engine, rollout: Rollout) -> Rollout:
    """TP and CP peers train on the same data: take the first peer's rollout."""
    for name in ("tp", "cp"):
        mesh = engine.parallel_dims.get_optional_mesh(name)
        if mesh is not None and mesh.size() > 1:
            box = [rollout]
            dist.broadcast_object_list(box, group_src=0, group=mesh.get_group())
            rollout = box[0]
    return rollout


def on_policy(cfg) -> bool:
    """One update per batch: the old log-probs are the current ones (the loss takes current.detach())."""
    return cfg.actor.ppo_epochs == 1 and cfg.data.train_batch_size == cfg.actor.ppo_mini_batch_size


def rollout_logprob_samples(cfg) -> int:
    """How many of each prompt's n responses need the sampler's log-probs: all where the loss uses them, the
    first one for the mismatch metric (enough for a mean, and vLLM's cost of returning them falls ~n-fold),
    none on-policy, where that metric has no old log-probs to compare with."""
    if cfg.actor.use_rollout_logprobs or cfg.algorithm.tis_cap is not None:
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
    result["actor/skipped_steps"] = totals["actor/skipped_steps"]
    return result


def train_step(cfg, step, engine, ref_engine, sampler, prompts_set, tokenizer) -> dict[str, float]:
    """One GRPO step: generate -> score -> group advantages -> old log-probs -> update -> weight sync."""
    timings, t0 = {}, time.perf_counter()
    prompts = prompts_set.batch(step, cfg.data.train_batch_size)[engine.dp_rank::engine.dp_size]
    n = cfg.rollout.n
    rollout = generate(sampler, engine, [ids for ids, _ in prompts], n, seed=step_seed(cfg, step, engine),
                       logprob_samples=rollout_logprob_samples(cfg))
    sampler.sleep()  # vLLM's memory goes to the update until the sync
    timings["gen"] = time.perf_counter() - t0

    rewards = score(cfg, tokenizer, rollout.response_ids, [truth for _, truth in prompts for _ in range(n)])
    a = cfg.algorithm
    advantages = grpo.group_advantages(torch.tensor(rewards), n, a.norm_adv_by_std, a.adv_epsilon).tolist()
    samples = [Sample(prompt, response, logprobs, advantage) for prompt, response, logprobs, advantage in
               zip(rollout.prompt_ids, rollout.response_ids, rollout.logprobs, advantages)]

    t = time.perf_counter()
    compute_old_and_ref_logprobs(cfg, engine, ref_engine, samples)
    timings["old_log_prob"] = time.perf_counter() - t

    t = time.perf_counter()
    metrics = update_actor(cfg, engine, samples)
    timings["update_actor"] = time.perf_counter() - t

    timings["update_weights"] = sampler.sync_weights()
    timings["step"] = time.perf_counter() - t0
    metrics.update(rollout_metrics(engine, samples, rollout, rewards))
    metrics.update({f"timing_s/{k}": v for k, v in timings.items()})
    metrics.update(perf_metrics(engine, samples, timings))
    return metrics


# ----------------------------------------------------------------------------- metrics


def rollout_metrics(engine, samples, rollout, rewards) -> dict[str, float]:
    """Global reward, length and mismatch means (summed over DP ranks)."""
    lengths = torch.tensor([float(len(s.response_ids)) for s in samples])
    truncated = torch.tensor([1.0 if f == "length" else 0.0 for f in rollout.finish_reasons])
    sums = [sum(rewards), lengths.sum().item(), truncated.sum().item(), float(len(samples))]
    measured = [s for s in samples if s.old_logprobs is not None and s.rollout_logprobs is not None]
    diffs = [grpo.rollout_mismatch(s.old_logprobs, torch.tensor(s.rollout_logprobs)) for s in measured]
    mismatch = [sum(d["abs_diff"].sum().item() for d in diffs), sum(d["k3"].sum().item() for d in diffs),
                float(sum(len(s.response_ids) for s in measured))]  # the mean is over the measured tokens
    total = engine.dp_all_reduce(torch.tensor(sums + mismatch, dtype=torch.float64)).tolist()
    count = max(total[3], 1.0)
    metrics = {
        "critic/score/mean": total[0] / count,
        "response_length/mean": total[1] / count,
        "response_length/clip_ratio": total[2] / count,
        "response_length/max": engine.dp_all_reduce(lengths.max(), dist.ReduceOp.MAX).item(),
    }
    if total[6] > 0:  # tokens with both log-probs
        metrics["rollout_corr/abs_logprob_diff"], metrics["rollout_corr/kl_k3"] = total[4] / total[6], total[5] / total[6]
    return metrics


def actor_flops(engine, sequence_lengths: list[int]) -> float:
    """Training FLOPs (fwd + bwd) of the actor update: 6 N T + 6 L h d sum(len^2) (causal attention)."""
    model_cfg = engine.trainer.model_config
    attention = model_cfg.layers[0].attention
    params = sum(p.numel() for p in engine.model.parameters())
    embedding = model_cfg.vocab_size * model_cfg.dim if not model_cfg.enable_weight_tying else 0
    dense = 6.0 * (params - embedding) * sum(sequence_lengths)
    attn = 6.0 * len(model_cfg.layers) * attention.n_heads * attention.head_dim * sum(n * n for n in sequence_lengths)
    return dense + attn


def perf_metrics(engine, samples, timings) -> dict[str, float]:
    """Throughput (tokens/s per device), actor MFU and peak memory."""
    lengths = [len(s.tokens) for s in samples]
    tokens, flops = engine.dp_all_reduce(torch.tensor([float(sum(lengths)), actor_flops(engine, lengths)],
                                                      dtype=torch.float64)).tolist()
    world = dist.get_world_size()
    tp_cp = world // engine.dp_size  # TP/CP peers hold the same tokens
    metrics = {"perf/throughput": tokens * tp_cp / timings["step"] / world}
    if engine.device_type == "cuda":
        peak = get_peak_flops(torch.cuda.get_device_name())
        metrics["perf/mfu/actor"] = flops * engine.cfg.actor.ppo_epochs / (timings["update_actor"] * peak * world / tp_cp)
        metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        metrics["perf/max_memory_allocated_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return metrics


def run_validation(cfg, engine, sampler, val_set, tokenizer) -> dict[str, float]:
    """Greedy mean@1 reward on the validation prompts, with a progress line per chunk."""
    items = val_set.items[: cfg.data.max_val_samples] if cfg.data.max_val_samples > 0 else val_set.items
    per_rank = -(-len(items) // engine.dp_size)
    mine = items[engine.dp_rank::engine.dp_size]
    padded = mine + [items[0]] * (per_rank - len(mine))  # every rank runs the same generate calls (lockstep)
    total = 0.0
    for start in range(0, per_rank, cfg.data.val_batch_size):
        chunk = padded[start:start + cfg.data.val_batch_size]
        rollout = generate(sampler, engine, [ids for ids, _ in chunk], 1, greedy=True, logprob_samples=0)
        scores = score(cfg, tokenizer, rollout.response_ids, [truth for _, truth in chunk])
        total += sum(scores[:max(len(mine) - start, 0)])  # padding does not count
        log(f"validation: {min((start + len(chunk)) * engine.dp_size, len(items))}/{len(items)} prompts")
    summed = engine.dp_all_reduce(torch.tensor([total, float(len(mine))], dtype=torch.float64)).tolist()
    return {gsm8k.VAL_METRIC: summed[0] / max(summed[1], 1.0)}


class MetricsLog:
    """metrics.jsonl in the output dir, plus trainer.logger's console line, TensorBoard, wandb (rank 0).

    A fresh run starts a fresh file; a resumed one keeps the rows up to the step it resumed from
    (rows of steps it redoes would otherwise appear twice).
    """

    CONSOLE = (("critic/score/mean", "score", "{:.3f}"), (gsm8k.VAL_METRIC, "val", "{:.3f}"),
               ("actor/pg_loss", "pg_loss", "{:.4g}"), ("actor/entropy", "entropy", "{:.3f}"),
               ("actor/grad_norm", "grad_norm", "{:.3g}"), ("response_length/mean", "response_len", "{:.0f}"),
               ("rollout_corr/abs_logprob_diff", "mismatch", "{:.2g}"), ("timing_s/gen", "gen_s", "{:.1f}"),
               ("timing_s/update_actor", "update_s", "{:.1f}"), ("timing_s/step", "step_s", "{:.1f}"),
               ("perf/throughput", "tok/s/gpu", "{:.0f}"), ("perf/mfu/actor", "mfu", "{:.1%}"))

    def __init__(self, cfg: Config, resumed_step: int):
        out = cfg.trainer.output_dir
        self.path, self.loggers = os.path.join(out, "metrics.jsonl"), cfg.trainer.logger
        self.rank0 = dist.get_rank() == 0
        if not self.rank0:
            return
        os.makedirs(out, exist_ok=True)
        kept = []
        if resumed_step > 0 and os.path.isfile(self.path):
            with open(self.path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resumed_step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        self.tensorboard = self.wandb = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(os.path.join(out, "tensorboard"), purge_step=resumed_step + 1)
        if "wandb" in self.loggers:  # WANDB_MODE=offline etc. are wandb's own switches
            import wandb

            self.wandb = wandb.init(project=cfg.trainer.project_name, name=cfg.trainer.experiment_name, dir=out,
                                    config=asdict(cfg), resume="allow")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.rank0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if "console" in self.loggers:
            shown = " ".join(f"{name}={fmt.format(metrics[key])}" for key, name, fmt in self.CONSOLE if key in metrics)
            print(f"step {step}: {shown}", flush=True)
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.rank0 and self.tensorboard is not None:
            self.tensorboard.close()
        if self.rank0 and self.wandb is not None:
            self.wandb.finish()


def log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


# ----------------------------------------------------------------------------- entry points


def build_reference(cfg: Config):
    """A frozen copy of the initial policy for the KL loss (built only when the loss is on)."""
    ref_cfg = copy.deepcopy(cfg)
    ref_cfg.trainer.output_dir = os.path.join(cfg.trainer.output_dir, "reference")
    ref_cfg.activation_checkpoint.mode = "none"
    return TorchTitanEngineWithLMHead(ref_cfg)


@dataclass
class Run:
    """What a GRPO run is made of: the actor, the optional KL reference, tokenizer, prompts and sampler."""

    engine: TorchTitanEngineWithLMHead
    ref_engine: TorchTitanEngineWithLMHead | None
    tokenizer: object
    train_set: PromptSet
    val_set: PromptSet
    sampler: object


def build_run(cfg: Config) -> Run:
    """Check the config, the output dir and the data; then build the engine(s) and the sampler (synced)."""
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    lock_output_dir(cfg.trainer.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(load_model_dir(cfg.model.path))
    train_set = PromptSet(load_data(cfg, "train"), tokenizer, cfg, "train")
    val_set = PromptSet(load_data(cfg, "val"), tokenizer, cfg, "val")
    torch.manual_seed(cfg.trainer.seed)
    engine = TorchTitanEngineWithLMHead(cfg)
    ref_engine = build_reference(cfg) if cfg.algorithm.use_kl_loss else None
    sampler = build_rollout(cfg, engine, eos_token_ids(engine.model_dir, tokenizer))  # holds the trainer's weights
    return Run(engine, ref_engine, tokenizer, train_set, val_set, sampler)


def load_data(cfg: Config, name: str) -> list[dict]:
    """The problems of data.train_files or data.val_files; bad data is a one-line error naming the setting."""
    setting, source = f"data.{name}_files", getattr(cfg.data, f"{name}_files")
    try:
        return gsm8k.load_problems(source, split=name, seed=cfg.data.seed + (name == "val"))
    except ValueError as error:
        raise ValueError(f"{setting}: {error}") from None


_output_dir_lock = None  # held open for the life of the process


def lock_output_dir(output_dir: str) -> None:
    """Rank 0 holds an exclusive lock on output_dir: a second run there stops at once, not racing the first."""
    global _output_dir_lock
    if int(os.environ.get("RANK", "0")) != 0:
        return
    os.makedirs(output_dir, exist_ok=True)
    handle = open(os.path.join(output_dir, ".lock"), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        raise RuntimeError(f"trainer.output_dir={output_dir} is in use by another run (pid {handle.read().strip()}); "
                           "stop that run or choose another trainer.output_dir") from None
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    _output_dir_lock = handle


def train(cfg: Config) -> dict[str, float]:
    """Run GRPO for trainer.total_training_steps; returns the last step's metrics."""
    run = build_run(cfg)
    engine, sampler, tokenizer = run.engine, run.sampler, run.tokenizer
    metrics_log = MetricsLog(cfg, engine.loaded_step)
    first = engine.loaded_step + 1
    if first > 1:
        log(f"resumed from step {engine.loaded_step}")
    if cfg.trainer.val_before_train and first == 1:
        metrics_log.write(0, run_validation(cfg, engine, sampler, run.val_set, tokenizer))
    metrics = {}
    for step in range(first, cfg.trainer.total_training_steps + 1):
        metrics = train_step(cfg, step, engine, run.ref_engine, sampler, run.train_set, tokenizer)
        last = step == cfg.trainer.total_training_steps
        if (cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0) or last:
            metrics.update(run_validation(cfg, engine, sampler, run.val_set, tokenizer))
        metrics_log.write(step, metrics)  # before the checkpoint: a resume from it never lacks this row
        if cfg.checkpoint.save_freq > 0 and (step % cfg.checkpoint.save_freq == 0 or last):  # verl saves the last
            engine.save_checkpoint(step)
    if cfg.checkpoint.export_hf and cfg.trainer.total_training_steps >= first:
        log(f"exported HF weights to {engine.export_hf(cfg.trainer.total_training_steps)}")
    metrics_log.close()
    dist.barrier()
    sampler.close()  # before the process group goes: vLLM's teardown frees its memory pools and groups
    return metrics


def eos_token_ids(model_dir: str, tokenizer) -> list[int]:
    """EOS ids from generation_config.json (Qwen3: <|im_end|> and <|endoftext|>), else the tokenizer's."""
    path = os.path.join(model_dir, "generation_config.json")
    ids = []
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return ids or [tokenizer.eos_token_id]


def main(argv: list[str]) -> None:
    train(parse_cli(argv))
    if dist.is_initialized():  # vLLM's shutdown has already destroyed it
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
