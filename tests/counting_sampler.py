"""A sampler module outside the repo root, for test_loop: the native sampler, counting its generate calls into
output_dir/sampler_calls.txt when it closes."""

import os

from native import NativeRollout


class CountingSampler(NativeRollout):
    """NativeRollout that counts what it is asked for."""

    def __init__(self, cfg, engine, eos_token_ids):
        super().__init__(cfg, engine, eos_token_ids)
        self.calls = 0

    def generate(self, *args, **kwargs):
        self.calls += 1
        return super().generate(*args, **kwargs)

    def close(self) -> None:
        if self.engine.dp_rank == 0:
            with open(os.path.join(self.cfg.trainer.output_dir, "sampler_calls.txt"), "w") as f:
                f.write(str(self.calls))


SAMPLER = CountingSampler
