"""Synthetic arithmetic in GSM8K's format ("What is 1+2?" -> "3"): GSM8K's prompt, reward and settings. The source
(`data.train_files` / `val_files`) names the problem set: `sums`, the 9 sums a+b with a, b < 3 for both splits (the CPU
demo: a tiny random model learns them in a minute), or `mixed`, 2000 seeded problems a op b (a, b in 0-9, op + - *)."""

import random

import gsm8k

Settings, build_prompt, score = gsm8k.Settings, gsm8k.build_prompt, gsm8k.score  # GSM8K's, as they are

VAL_METRIC = "val-core/arithmetic/reward/mean@1"
PROBLEMS_PER_SPLIT = 2000


def load_problems(source: str, split: str = "train", seed: int = 0) -> list[dict]:
    """The problem set `source` names (`sums` or `mixed`; the loop seeds each split)."""
    if source == "sums":
        return [{"question": f"What is {a}+{b}?", "ground_truth": str(a + b)} for a in range(3) for b in range(3)]
    if source != "mixed":
        raise ValueError(f"{source} is no problem set of the arithmetic task; use sums or mixed")
    rng = random.Random(seed)
    problems = []
    for _ in range(PROBLEMS_PER_SPLIT):
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        problems.append({"question": f"What is {a}{op}{b}?", "ground_truth": str(value)})
    return problems
