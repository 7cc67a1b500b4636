"""Metric loggers beside metrics.jsonl and the console line (`--trainer.logger tensorboard wandb`), on rank 0: each
has `log(metrics, step)` and `close()`."""

import os
from dataclasses import asdict


class TensorBoard:
    """Scalars under output_dir/tensorboard; a resume drops the events after its step."""

    def __init__(self, cfg, resumed_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(cfg.trainer.output_dir, "tensorboard"), purge_step=resumed_step + 1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Wandb:
    """A wandb run named by trainer.project_name / experiment_name (WANDB_MODE=offline etc. are wandb's own)."""

    def __init__(self, cfg, resumed_step: int):
        import wandb

        self.run = wandb.init(project=cfg.trainer.project_name, name=cfg.trainer.experiment_name,
                              dir=cfg.trainer.output_dir, config=asdict(cfg), resume="allow")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


LOGGERS = {"tensorboard": TensorBoard, "wandb": Wandb}  # trainer.logger names beside "console"
