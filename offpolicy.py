"""One-step off-policy GRPO (`--trainer.one_step_off_policy True`, verl's recipe on the same GPUs): while step t
computes old log-probs and updates, a background thread generates step t+1's groups from the weights vLLM holds,
the ones before step t's update. The loop takes a step's groups from `OneStepOffPolicy` instead of generating them.
"""

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist


def clashes(cfg, sampler) -> tuple[tuple[bool, str, str], ...]:
    """(clashes with the mode, the setting that must change, why) for config.validate."""
    return (
        (not sampler.generates_beside_the_trainer, "rollout.name=vllm_process",
         f"rollout.name={cfg.rollout.name} cannot generate beside the update"),
        (cfg.rollout.free_cache_engine, "rollout.free_cache_engine=False", "vLLM generates during the update"),
        (cfg.algorithm.filter_groups, "algorithm.filter_groups=False", "dynamic sampling counts groups over ranks"),
        (cfg.actor.use_rollout_logprobs, "actor.use_rollout_logprobs=False",
         "the old log-probs are the trainer's before the update"),
    )


class OneStepOffPolicy:
    """The step's groups, drawn one update earlier (staleness 1; step 1 draws its own, staleness 0), and the next
    step's started beside this step's update. A checkpoint keeps the finished next batch: a resume trains on what
    the uninterrupted run would.

    `draw(slot)`: this rank's groups of a prompt slot and their scores, with no collective (it runs beside the
    update); `share(groups)`: the model-parallel peers' common copy (a collective: on the trainer's thread)."""

    def __init__(self, draw: Callable, share: Callable, last_step: int):
        self.draw, self.share, self.last_step = draw, share, last_step
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self.running, self.ready, self.staleness = None, None, 0

    def take(self, step: int):
        """This step's (rollout, scores, metrics), shared with the model-parallel peers; starts the next step's."""
        self.staleness = 0 if self.ready is None else 1  # updates between the drawing weights and this step's
        groups, self.ready = self.ready or self.draw(step), None
        if step < self.last_step:
            self.running = self.pool.submit(self._beside_the_trainer, step + 1)
        rollout, scores = self.share(groups)
        return rollout, scores, {"rollout/staleness": float(self.staleness)}

    def update_done(self) -> dict[str, float]:
        """Wait for the next step's groups before vLLM takes the new weights; the seconds waited and generated."""
        if self.running is None:
            return {"wait_rollout": 0.0, "gen_ahead": 0.0}
        start = time.perf_counter()
        self.ready, generation_s = self.running.result()
        self.running = None
        return {"wait_rollout": time.perf_counter() - start, "gen_ahead": generation_s}

    def _beside_the_trainer(self, slot: int):
        """draw(slot) and its wall seconds (vLLM generates in its own process: this thread mostly waits)."""
        start = time.perf_counter()
        return self.draw(slot), time.perf_counter() - start

    def save(self, folder: str) -> None:
        """Keep the finished next batch beside the checkpoint (one file per rank)."""
        if self.ready is not None:
            torch.save(self.ready, self._path(folder))

    def load(self, folder: str) -> None:
        """The next batch a checkpoint kept, if any (else the resumed step draws its own)."""
        path = self._path(folder)
        self.ready = torch.load(path, weights_only=False) if os.path.isfile(path) else None

    def close(self) -> None:
        """Let the background thread go."""
        self.pool.shutdown(wait=True)

    @staticmethod
    def _path(folder: str) -> str:
        return os.path.join(folder, f"next_groups_rank{dist.get_rank()}.pt")
