"""What a run reports and where: the step's metrics (verl's names), metrics.jsonl and the loggers, and the console
lines that are known noise."""

import json
import logging
import os
import resource
import warnings

import torch
import torch.distributed as dist
from torchtitan.tools.utils import get_peak_flops

import grpo
from config import Config
from loggers import LOGGERS


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
        "response_length/max": engine.dp_all_reduce(lengths.max() if samples else torch.tensor(0.0),
                                                    dist.ReduceOp.MAX).item(),
    }
    if total[6] > 0:  # tokens with both log-probs
        metrics["rollout_corr/abs_logprob_diff"] = total[4] / total[6]
        metrics["rollout_corr/kl_k3"] = total[5] / total[6]
    return metrics


def perf_metrics(engine, samples, timings) -> dict[str, float]:
    """Throughput (tokens/s per device), actor MFU and peak memory."""
    lengths = [len(s.tokens) for s in samples]
    tokens, flops = engine.dp_all_reduce(torch.tensor([float(sum(lengths)), engine.training_flops(lengths)],
                                                      dtype=torch.float64)).tolist()
    world = dist.get_world_size()
    tp_cp = world // engine.dp_size  # TP/CP peers hold the same tokens
    metrics = {"perf/throughput": tokens * tp_cp / timings["step"] / world}
    if engine.device_type == "cuda":
        peak = get_peak_flops(torch.cuda.get_device_name())
        update_s = timings["update_actor"]
        metrics["perf/mfu/actor"] = flops * engine.cfg.actor.ppo_epochs / (update_s * peak * world / tp_cp)
        metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        metrics["perf/max_memory_allocated_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return metrics


class MetricsLog:
    """metrics.jsonl in the output dir, plus trainer.logger's console line and loggers.py's (rank 0). A fresh run
    starts a fresh file; a resumed one keeps the rows up to its step (rows of steps it redoes would repeat)."""

    CONSOLE = (("critic/score/mean", "score", "{:.3f}"), ("critic/score/all_mean", "score_all", "{:.3f}"),
               ("val", "val", "{:.3f}"),
               ("actor/pg_loss", "pg_loss", "{:.4g}"), ("actor/entropy", "entropy", "{:.3f}"),
               ("actor/grad_norm", "grad_norm", "{:.3g}"), ("response_length/mean", "response_len", "{:.0f}"),
               ("rollout_corr/abs_logprob_diff", "mismatch", "{:.2g}"), ("timing_s/gen", "gen_s", "{:.1f}"),
               ("timing_s/update_actor", "update_s", "{:.1f}"), ("timing_s/step", "step_s", "{:.1f}"),
               ("perf/throughput", "tok/s/gpu", "{:.0f}"), ("perf/mfu/actor", "mfu", "{:.1%}"))

    def __init__(self, cfg: Config, resumed_step: int, val_metric: str):
        out = cfg.trainer.output_dir
        self.console = [(val_metric if key == "val" else key, name, fmt) for key, name, fmt in self.CONSOLE]
        self.path, self.loggers = os.path.join(out, "metrics.jsonl"), cfg.trainer.logger
        self.rank0 = dist.get_rank() == 0
        self.scores, self.val_metric, self.vals = [], val_metric, []  # this process's rows, for the summary
        if not self.rank0:
            return
        os.makedirs(out, exist_ok=True)
        kept = []
        if resumed_step > 0 and os.path.isfile(self.path):
            with open(self.path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resumed_step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        self.backends = [LOGGERS[name](cfg, resumed_step) for name in self.loggers if name in LOGGERS]

    def write(self, step: int, metrics: dict[str, float]) -> None:
        score = metrics.get("critic/score/all_mean", metrics.get("critic/score/mean"))
        self.scores += [] if score is None else [score]
        self.vals += [metrics[self.val_metric]] if self.val_metric in metrics else []
        if not self.rank0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if "console" in self.loggers:
            shown = " ".join(f"{name}={fmt.format(metrics[key])}" for key, name, fmt in self.console if key in metrics)
            print(f"step {step}: {shown}", flush=True)
        for backend in self.backends:
            backend.log(metrics, step)

    def summary(self, seconds: float, checkpoint: str | None, export: str | None) -> str:
        """One line at the end of a run: mean reward over its first 3 and last 10 steps, validation first -> last,
        wall seconds, and where its files are."""
        parts = [f"done in {seconds:.0f} s"]
        if self.scores:
            first, last = self.scores[:3], self.scores[-10:]
            parts.append(f"reward {sum(first) / len(first):.3f} -> {sum(last) / len(last):.3f} (mean of the first "
                         f"{len(first)} and last {len(last)} steps)")
        if self.vals:
            parts.append(f"validation {self.vals[0]:.3f} -> {self.vals[-1]:.3f}")
        files = [f"metrics {self.path}"] + [f"{name} {path}" for name, path in
                                            (("checkpoint", checkpoint), ("HF export", export)) if path]
        return "; ".join(parts + files)

    def close(self) -> None:
        for backend in self.backends if self.rank0 else []:
            backend.close()


def log(message: str) -> None:
    if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0:
        print(message, flush=True)


def quiet_known_noise() -> None:
    """Silence third-party lines that read as failures but are not (set once, at the entry point)."""
    logging.getLogger().addFilter(lambda record: not record.getMessage().startswith(KNOWN_NOISE))  # torchtitan's logger
    warnings.filterwarnings("ignore", message="DTensor .* may not have complete support on cpu")  # random ops, seed
    # vLLM's in-place reload warns per sync, rank and layer whose only tensors (RoPE's cache) no checkpoint holds
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)


KNOWN_NOISE = (
    "Error running lspci",  # torchtitan then reads the device name, as it should
    "Peak flops undefined for: cpu",  # MFU is reported on GPUs only
    "torch.distributed is already initialized",  # the engine initialises it (gloo beside nccl), on purpose
    "model.safetensors.index.json not found",  # a one-file checkpoint has none; the export writes one file
)
