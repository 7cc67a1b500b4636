"""Run under torchrun: the GRPO loss's gradient and pg_loss for eight fixed samples, with a given
micro-batch budget and layout; rank 0 saves them for comparison across layouts.

    torchrun --nproc_per_node=N tests/gradient_worker.py OUT.pt MODEL_DIR BUDGET [--section.field value ...]
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import parse_cli  # noqa: E402
from engine import TorchTitanEngineWithLMHead  # noqa: E402
from loop import Sample, forward_backward_batch, grpo_loss_fn  # noqa: E402


def fixed_samples() -> list[Sample]:
    """Eight prompt + response samples of mixed lengths with random advantages."""
    g = torch.Generator().manual_seed(0)
    return [Sample(torch.randint(0, 40, (5,), generator=g).tolist(), torch.randint(0, 40, (int(n),), generator=g).tolist(),
                   [0.0] * int(n), float(torch.randn(1, generator=g))) for n in torch.randint(2, 9, (8,), generator=g)]


def main():
    out, model_dir, budget, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    cfg = parse_cli(["--model.path", model_dir, "--model.attn_type", "sdpa", "--model.dtype", "float32",
                     "--trainer.device", "cpu", "--trainer.output_dir", out + "_run", "--algorithm.loss_agg_mode",
                     "seq-mean-token-mean", "--actor.max_tokens_per_micro_batch", budget, *extra])
    engine = TorchTitanEngineWithLMHead(cfg)
    samples = fixed_samples()
    tokens = sum(len(s.response_ids) for s in samples)  # global counts, as update_actor sums them over DP
    mine = samples[engine.dp_rank::engine.dp_size]
    with engine.train_mode():
        metrics = forward_backward_batch(engine, mine, grpo_loss_fn(cfg, tokens, len(samples)), 1.0)
    grad = torch.cat([p.grad.full_tensor().flatten() for p in engine.model.parameters()])  # the masters' again
    loss = engine.dp_all_reduce(torch.tensor([metrics["actor/pg_loss"]])).item()
    if engine.dp_rank == 0:
        torch.save({"grad": grad, "pg_loss": loss}, out)
    dist.barrier()  # every rank done before any tears down its gloo pairs (as the other workers end)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
