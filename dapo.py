"""DAPO's dynamic sampling (`--algorithm.filter_groups True`): a step trains only on groups whose rewards differ (a
group that agrees has zero advantage), drawn from as many generation batches as it takes. The loop's on-policy groups
source calls a `DynamicSampling` instead of drawing one prompt slot a step."""

from collections.abc import Callable

import torch
import torch.distributed as dist

from config import Config, SettingError
from metrics import log
from rollout import Rollout


class DynamicSampling:
    """`draw(slot)` gives a prompt slot's groups and scores (shared with the model-parallel peers); called with a
    step, this keeps the informative groups of the step's slots until every DP rank holds train_batch_size / DP."""

    def __init__(self, cfg: Config, engine, draw: Callable):
        self.cfg, self.engine, self.draw = cfg, engine, draw

    def __call__(self, step: int) -> tuple[Rollout, list[float], dict[str, float]]:
        """This rank's groups of the step, their scores and metrics. Generation batch g of a step is prompt slot
        (step - 1) x max_num_gen_batches + g of the shuffled order, so a resume redraws the same. At
        max_num_gen_batches the step trains on the groups it found, every rank on as many (none: no update), unless
        algorithm.stop_at_max_gen_batches stops the run as verl does."""
        engine, n, a = self.engine, self.cfg.rollout.n, self.cfg.algorithm
        wanted, batches = self.cfg.data.train_batch_size // engine.dp_size, a.max_num_gen_batches
        kept, scores, generated, all_scores = Rollout([], [], [], []), [], 0, 0.0
        for batch in range(batches):
            rollout, new = self.draw((step - 1) * batches + batch + 1)
            for g in informative_groups(new, n):
                for name, values in vars(rollout).items():
                    getattr(kept, name).extend(values[g * n:(g + 1) * n])
                scores.extend(new[g * n:(g + 1) * n])
            generated, all_scores = generated + len(new) // n, all_scores + sum(new)
            held = int(engine.dp_all_reduce(torch.tensor([len(scores) // n]), dist.ReduceOp.MIN).item())  # all ranks
            if held >= wanted:
                break
        else:
            found = f"step {step} found {held} of {wanted} groups whose rewards differ on a rank"
            if a.stop_at_max_gen_batches:
                raise SettingError(f"algorithm.max_num_gen_batches={batches}: {found}; raise it (or check that the "
                                   "task's rewards vary)")
            log(f"{found} in {batches} generation batches: " + (f"it trains on {held}" if held else "no update"))
        groups, generated, all_scores = engine.dp_all_reduce(torch.tensor([len(scores) / n, generated, all_scores],
                                                                          dtype=torch.float64)).tolist()
        metrics = {"train/num_gen_batches": batch + 1, "train/kept_group_ratio": groups / generated,
                   "critic/score/all_mean": all_scores / (generated * n)}
        used = min(held, wanted) * n
        return Rollout(*(values[:used] for values in vars(kept).values())), scores[:used], metrics


def informative_groups(scores: list[float], n: int) -> list[int]:
    """DAPO's keep rule: the indices of the groups (n consecutive scores each) whose scores differ; verl keeps a
    group of one too, which has no spread to judge."""
    return [g for g in range(len(scores) // n) if n == 1 or len(set(scores[g * n:(g + 1) * n])) > 1]
