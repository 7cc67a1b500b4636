"""Run under torchrun: vLLM (CPU) on every rank beside the trainer; compare the sampler's log-probs
with the engine's at start, after an optimizer step (stale) and after a weight sync; save the largest
differences over all ranks (rank 0).

    torchrun --nproc_per_node=N tests/rollout_worker.py OUT.pt MODEL_DIR [--section.field value ...]
"""

import os
import sys
import threading

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import parse_cli, sampler_class, validate  # noqa: E402
from engine import TorchTitanEngineWithLMHead  # noqa: E402
from loop import Sample, compute_logprobs, share_within_model_parallel  # noqa: E402
from rollout import build_rollout  # noqa: E402
from vllm_process import largest_parameter_bytes  # noqa: E402

# the last prompt fills a whole KV block (vLLM CPU: 128 tokens): with prefix caching on, a block cached before a
# weight sync would be served after it unless the sync resets the cache
PROMPTS = [[1, 4, 6, 9, 12], [1, 4, 6, 15, 11, 16, 17], [1, 5, 7, 8], [1] + [3 + i % 15 for i in range(129)]]
TEMPERATURE = 0.8
EOS = 2  # tiny.py's <|im_end|>


def max_over_ranks(value: float) -> float:
    box = torch.tensor([value])
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return box.item()


def well_formed(rollout, prompts, n: int, max_tokens: int) -> bool:
    """n sampled responses per prompt, consecutive; each ends with EOS ("stop") or at max_tokens ("length")."""
    grouped = rollout.prompt_ids == [p for p in prompts for _ in range(n)]
    sampled = len(set(map(tuple, rollout.response_ids))) > 1
    ends = all(0 < len(r) <= max_tokens and (f == "stop") == (r[-1] == EOS) and (f == "stop" or len(r) == max_tokens)
               for r, f in zip(rollout.response_ids, rollout.finish_reasons))
    return grouped and sampled and ends


def mismatch(engine, sampler, seed: int, checks: list[bool], logprob_samples: int | None = None) -> float:
    """Largest |sampler log-prob - engine log-prob| over this rank's share of the prompts, all ranks;
    appends whether the rollout was well formed, log-probs where asked only, to `checks`."""
    mine = PROMPTS[engine.dp_rank::engine.dp_size]
    rollout = share_within_model_parallel(engine, sampler.generate(mine, 3, seed=seed, logprob_samples=logprob_samples))
    asked = [i % 3 < (3 if logprob_samples is None else logprob_samples) for i in range(len(rollout.logprobs))]
    checks.append(well_formed(rollout, mine, 3, engine.cfg.data.max_response_length)
                  and [lp is not None for lp in rollout.logprobs] == asked)
    samples = [Sample(p, r, lp) for p, r, lp in zip(rollout.prompt_ids, rollout.response_ids, rollout.logprobs)
               if lp is not None]
    got = compute_logprobs(engine, samples, TEMPERATURE)
    want = torch.tensor([x for s in samples for x in s.rollout_logprobs])
    return max_over_ranks((torch.cat(got) - want).abs().max().item())


def train_one_step(engine) -> None:
    """One large-LR optimizer step on a fixed sequence, so that the sampler's weights go stale."""
    with engine.train_mode():
        logprobs, _ = engine.forward(torch.tensor([[1, 4, 6, 9, 12, 3, 5]]), torch.arange(7)[None],
                                     torch.tensor([[4, 6, 9, 12, 3, 5, -100]]))
        engine.backward(-logprobs.sum())
        engine.optimizer_step()


def main():
    out, model_dir, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = parse_cli(["--model.path", model_dir, "--model.attn_type", "sdpa", "--model.dtype", "float32",
                     "--trainer.device", "cpu", "--trainer.output_dir", out + "_run", "--rollout.name", "vllm",
                     "--data.max_response_length", "6", "--data.max_prompt_length", "130",
                     "--rollout.temperature", str(TEMPERATURE), "--optimizer.lr", "5e-2",
                     "--rollout.gpu_memory_utilization", "0.1", *extra])
    validate(cfg, int(os.environ["WORLD_SIZE"]))
    os.environ.update(sampler_class(cfg).environment)  # as loop.main
    engine = TorchTitanEngineWithLMHead(cfg)
    sampler = build_rollout(cfg, engine, [EOS])
    checks = []
    result = {"init": mismatch(engine, sampler, 1, checks)}
    result["client_threads_here"] = sorted(t.name for t in threading.enumerate()  # vLLM's multiprocess client's
                                           if t.name.startswith(("EngineCore", "MPClient")))
    # the loop's request (log-probs for the first response per prompt): two vLLM requests per prompt
    draws = [sampler.generate(PROMPTS, 3, seed=seed, logprob_samples=1).response_ids for seed in (1, 1, 3)]
    result["seeded"] = max_over_ranks(float(draws[0] != draws[1] or draws[0] == draws[2])) == 0.0
    train_one_step(engine)
    result["stale"] = mismatch(engine, sampler, 2, checks)
    result["sync_s"] = max_over_ranks(sampler.sync_weights())
    result["synced"] = mismatch(engine, sampler, 2, checks)
    result["synced_first_only"] = mismatch(engine, sampler, 3, checks, logprob_samples=1)
    result["well_formed"] = max_over_ranks(float(not all(checks))) == 0.0  # every call on every rank
    exported = max(t.numel() * t.element_size() for _, t in engine.export_hf_weights(dtype=sampler.dtype))
    result["export_fits_transfer_buffer"] = max_over_ranks(
        float(exported > largest_parameter_bytes(engine.model, sampler.dtype))) == 0.0
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()
    sampler.close()  # an in-process vLLM's teardown destroys the default process group, as at the end of loop.train
    if cfg.rollout.name == "vllm_process":  # an engine in its own process leaves it
        dist.destroy_process_group()
    assert not dist.is_initialized()


if __name__ == "__main__":
    main()
