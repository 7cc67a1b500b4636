"""Synthetic single-digit arithmetic in GSM8K's format ("What is 3+4?" -> "7"), the CPU demo's task: GSM8K's
prompt, reward and settings; the problems come from the seed (`data.train_files` / `val_files` are not read)."""

import random

import gsm8k

Settings, build_prompt, score = gsm8k.Settings, gsm8k.build_prompt, gsm8k.score  # GSM8K's, as they are

VAL_METRIC = "val-core/arithmetic/reward/mean@1"
PROBLEMS_PER_SPLIT = 2000


def load_problems(source: str, split: str = "train", seed: int = 0) -> list[dict]:
    """Seeded problems a op b with a, b in 0-9 and op in + - * (`source` unused; the loop seeds each split)."""
    rng = random.Random(seed)
    problems = []
    for _ in range(PROBLEMS_PER_SPLIT):
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        problems.append({"question": f"What is {a}{op}{b}?", "ground_truth": str(value)})
    return problems
