"""What a run reads before any heavy work (`check_inputs`: settings, output dir (created and locked), model dir, data)
and a task's problems as tokenized chat prompts: `load_data` (the task's loader, bad data one line naming the
setting), `PromptSet` (a resumable order of prompt batches) and the model's EOS ids."""

import fcntl
import json
import os

import torch
from transformers import AutoTokenizer

from config import Config, SettingError, load_plugin, validate
from engine import load_model_dir
from metrics import log


def check_inputs(cfg: Config):
    """What a run refuses before any heavy work: the settings, the output dir (created, locked), the model dir and
    the data; returns the task, tokenizer and prompt sets."""
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    lock_output_dir(cfg.trainer.output_dir)
    task = load_plugin("data.task", cfg.data.task)
    tokenizer = AutoTokenizer.from_pretrained(load_model_dir(cfg.model.path))
    train_set = PromptSet(load_data(cfg, task, "train"), task, tokenizer, cfg, "train")
    if len(train_set.items) < cfg.data.train_batch_size:
        log(f"data.train_batch_size={cfg.data.train_batch_size} is more than the {len(train_set.items)} training "
            "prompts: each batch repeats prompts (the order is reshuffled on every pass)")
    return task, tokenizer, train_set, PromptSet(load_data(cfg, task, "val"), task, tokenizer, cfg, "val")


_output_dir_lock = None  # held open for the life of the process


def lock_output_dir(output_dir: str) -> None:
    """Rank 0 holds an exclusive lock on output_dir: a second run there stops at once, not racing the first."""
    global _output_dir_lock
    if int(os.environ.get("RANK", "0")) != 0:
        return
    try:
        os.makedirs(output_dir, exist_ok=True)
        handle = open(os.path.join(output_dir, ".lock"), "a+")
    except OSError as error:  # e.g. under /proc, where the writability check passes for root
        raise SettingError(f"trainer.output_dir={output_dir} cannot be created ({error.strerror}); "
                           "pick another") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        raise SettingError(f"trainer.output_dir={output_dir} is in use by another run (pid {handle.read().strip()}); "
                           "stop that run or choose another trainer.output_dir") from None
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    _output_dir_lock = handle


class PromptSet:
    """Tokenized chat prompts; over-long ones dropped (and counted), never truncated."""

    def __init__(self, problems: list[dict], task, tokenizer, cfg: Config, name: str):
        self.items, dropped = [], 0
        for problem in problems:
            ids = tokenizer.apply_chat_template(
                task.build_prompt(problem["question"]), add_generation_prompt=True, tokenize=True,
                enable_thinking=cfg.data.enable_thinking,
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            if len(ids) > cfg.data.max_prompt_length:
                dropped += 1
                continue
            self.items.append((ids, problem["ground_truth"]))
        if not self.items:
            raise SettingError(f"data.{name}_files: every prompt is longer than data.max_prompt_length; raise it")
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


def load_data(cfg: Config, task, name: str) -> list[dict]:
    """The task's problems of data.train_files or data.val_files; bad data is a one-line error naming the setting."""
    setting, source = f"data.{name}_files", getattr(cfg.data, f"{name}_files")
    try:
        return task.load_problems(source, split=name, seed=cfg.data.seed + (name == "val"))
    except ValueError as error:
        raise SettingError(f"{setting}: {error}") from None


def eos_token_ids(model_dir: str, tokenizer) -> list[int]:
    """EOS ids from generation_config.json (Qwen3: <|im_end|> and <|endoftext|>), else the tokenizer's."""
    path = os.path.join(model_dir, "generation_config.json")
    ids = []
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return ids or [tokenizer.eos_token_id]
