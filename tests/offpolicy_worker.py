"""Run under torchrun: three one-step off-policy GRPO steps with vLLM (float32 CPU) on arithmetic
prompts. For each step's samples: the largest difference between their rollout log-probs and the engine's under
the weights of one update before the step's start, and under the step's starting weights; the seeds of the
generate calls; what is left running after the last step; whether the trainer thread's torch and numpy RNG states are
what they were before each step.

    torchrun --nproc_per_node=N tests/offpolicy_worker.py OUT.pt MODEL_DIR DATA.jsonl [--section.field value ...]
"""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import loop  # noqa: E402
from config import parse_cli, sampler_class  # noqa: E402

STEPS = 3


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


def largest_difference(engine, samples, weights, temperature) -> float:
    """max |rollout log-prob - engine log-prob| over the samples' tokens, with `weights` in the engine."""
    now = snapshot(engine)
    load(engine, weights)
    logprobs = loop.compute_logprobs(engine, samples, temperature)
    load(engine, now)
    local = max((lp - torch.tensor(s.rollout_logprobs)).abs().max().item() for s, lp in zip(samples, logprobs))
    return float(engine.dp_all_reduce(torch.tensor([local]), dist.ReduceOp.MAX).item())


def load(engine, weights) -> None:
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            p.copy_(weights[name])


def main():
    out, model_dir, data, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    cfg = parse_cli([
        "--model.path", model_dir, "--model.attn_type", "sdpa", "--model.dtype", "float32", "--trainer.device", "cpu",
        "--trainer.output_dir", out + "_run", "--rollout.name", "vllm_process", "--rollout.gpu_memory_utilization",
        "0.1", "--rollout.free_cache_engine", "False", "--trainer.one_step_off_policy", "True",
        "--data.train_files", data, "--data.val_files", data, "--data.train_batch_size", "4",
        "--actor.ppo_mini_batch_size", "4", "--rollout.n", "4", "--data.max_response_length", "3",
        "--data.max_prompt_length", "64", "--optimizer.lr", "2e-2", "--reward.method", "flexible",
        "--algorithm.entropy_coeff", "1.0",  # a gradient whatever the rewards: the weights change every step
        "--trainer.total_training_steps", str(STEPS), *extra])
    os.environ.update(sampler_class(cfg).environment)  # as loop.main
    run = loop.build_run(cfg)
    seeds, taken = [], []
    generate, take = run.sampler.generate, run.groups.take

    def counted_generate(*args, **kwargs):
        seeds.append(kwargs["seed"])
        return generate(*args, **kwargs)

    run.sampler.generate = counted_generate
    run.groups.take = lambda *args: taken.append(take(*args)) or taken[-1]
    weights = [snapshot(run.engine)]  # weights[k]: after k updates
    result = {"drawn_by": [], "step_start": [], "staleness": [], "rng_kept": []}
    for step in range(1, STEPS + 1):
        rng = torch.get_rng_state(), np.random.get_state()[1].copy()
        metrics = loop.train_step(cfg, step, run)  # generates the next step's groups on the background thread
        result["rng_kept"].append(torch.equal(rng[0], torch.get_rng_state())
                                  and np.array_equal(rng[1], np.random.get_state()[1]))
        weights.append(snapshot(run.engine))
        rollout, _, _ = taken[-1]
        samples = [loop.Sample(p, r, lp) for p, r, lp in zip(rollout.prompt_ids, rollout.response_ids, rollout.logprobs)]
        for key, k in (("drawn_by", max(step - 2, 0)), ("step_start", step - 1)):
            result[key].append(largest_difference(run.engine, samples, weights[k], cfg.rollout.temperature))
        result["staleness"].append(metrics["rollout/staleness"])
    result["responses"] = [rollout.response_ids for rollout, _, _ in taken]
    result["seeds"] = seeds
    result["step_seeds"] = [loop.step_seed(cfg, step, run.engine) for step in range(1, STEPS + 1)]
    result["left_running"] = run.groups.running is not None or run.groups.ready is not None
    run.sampler.close()
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(result, out)


if __name__ == "__main__":
    main()
