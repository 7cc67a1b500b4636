"""GSM8K: dataset, prompt and reward. A task module (`--data.task`), the file a fork copies for another task:
`load_problems`, `build_prompt`, `score`, `VAL_METRIC` and `Settings` (the `--reward.*` flags, passed to `score`)."""

import json
import os
import re
from dataclasses import dataclass
from typing import Literal

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
VAL_METRIC = "val-core/openai/gsm8k/reward/mean@1"  # verl's name: val-core/<data source>/reward/mean@<n>
SOLUTION_CLIP_CHARS = 300  # verl: only the response tail is searched for the answer


def ground_truth_of(answer: str) -> str:
    """The number after '#### ' in a GSM8K answer, commas removed."""
    return answer.split("#### ")[-1].strip().replace(",", "")


HUB_SPLITS = {"train": "train", "val": "test"}  # the hub dataset's split for data.train_files / data.val_files
FILE_FORMATS = (".csv", ".tsv", ".json", ".txt", ".arrow", ".xlsx")  # files, not hub names: refused by name


@dataclass
class Settings:
    """The `--reward.*` flags: verl's GSM8K reward options."""

    method: Literal["strict", "flexible"] = "strict"  # strict: the last '#### number'; flexible: the last number
    format_score: float = 0.0  # score for a well-formed but wrong answer
    correct_score: float = 1.0  # score for a correct answer


def load_problems(source: str, split: str = "train", seed: int = 0) -> list[dict]:
    """Problems from a jsonl/parquet path (openai or verl schema) or a hub dataset (its train or test split for
    split "train" / "val"), in the source's order; ValueError naming the file and line for bad input."""
    if source.endswith((".jsonl", ".parquet")) and not os.path.isfile(source):
        raise ValueError(f"{source} does not exist")
    if (os.path.isfile(source) and not source.endswith((".jsonl", ".parquet"))) or source.endswith(FILE_FORMATS):
        raise ValueError(f"{source} is no .jsonl or .parquet file; convert it, or give a hub dataset name")
    if source.endswith(".jsonl"):
        rows = _read_jsonl(source)
    elif source.endswith(".parquet"):
        import pandas as pd

        rows = pd.read_parquet(source).to_dict("records")
    else:  # a hub dataset name, e.g. openai/gsm8k (needs network)
        import datasets

        try:
            rows = list(datasets.load_dataset(source, "main", split=HUB_SPLITS[split]))
        except Exception as error:  # offline, no such dataset, no "main" config: one line, not datasets' traceback
            raise ValueError(f"{source} could not be loaded as a hub dataset ({type(error).__name__}: "
                             f"{str(error).strip().splitlines()[0][:200]})") from None
    if not rows:
        raise ValueError(f"{source} has no rows")
    return [_problem_from_row(row, source, index) for index, row in enumerate(rows, 1)]


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {number} is not JSON ({error})") from None
    return rows


def _problem_from_row(row: dict, source: str, index: int) -> dict:
    if "question" in row and "answer" in row:  # openai/grade-school-math jsonl
        return {"question": row["question"], "ground_truth": ground_truth_of(row["answer"])}
    try:  # verl's preprocessed parquet: question in extra_info, answer in reward_model
        return {"question": row["extra_info"]["question"], "ground_truth": str(row["reward_model"]["ground_truth"])}
    except (KeyError, TypeError):
        raise ValueError(
            f"{source} row {index} has neither question/answer (openai GSM8K) nor extra_info.question/"
            f"reward_model.ground_truth (verl parquet); its keys: {sorted(row)}"
        ) from None


def build_prompt(question: str) -> list[dict]:
    """One user message: the question and the step-by-step instruction (verl's GSM8K prompt)."""
    return [{"role": "user", "content": f"{question} {INSTRUCTION}"}]


def extract_answer(response: str, method: str = "strict") -> str | None:
    """strict: the last '#### number'; flexible: the last number. Only the last 300 chars count."""
    tail = response[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    numbers = [n for n in re.findall(r"(\-?[0-9\.\,]+)", tail) if n not in ("", ".")]
    return numbers[-1].replace(",", "") if numbers else None


def score(response: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
          correct_score: float = 1.0) -> float:
    """verl gsm8k reward: correct_score if the answer matches, format_score if one was found, else 0."""
    answer = extract_answer(response, method)
    if answer is None:
        return 0.0
    return correct_score if answer == ground_truth else format_score
