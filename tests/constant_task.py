"""A task module outside the repo root, for test_loop: a fixed reward set by its own `--reward.constant` flag."""

from dataclasses import dataclass

VAL_METRIC = "val-core/constant/reward/mean@1"


@dataclass
class Settings:
    constant: float = 1.0  # the reward of every response
    method: str = "unused"  # a name gsm8k's Settings has too: each task has its own reward section


def load_problems(source: str, split: str = "train", seed: int = 0) -> list[dict]:
    """7 training and 3 validation problems (the source is not read)."""
    return [{"question": f"What is {i}+0?", "ground_truth": str(i)} for i in range(7 if split == "train" else 3)]


def build_prompt(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def score(response: str, ground_truth: str, constant: float, method: str) -> float:
    return constant
