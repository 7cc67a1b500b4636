"""The task modules: GSM8K's reward on every gold test answer (tests/data: GSM8K's MIT-licensed test split) and on
hand-written bad responses; the synthetic arithmetic task."""

import json
import os
import sys
from types import SimpleNamespace

import pytest

import arithmetic
import gsm8k

TEST_FILE = os.path.join(os.path.dirname(__file__), "data", "gsm8k_test.jsonl")


def test_every_gold_answer_scores_one():
    with open(TEST_FILE) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 1319
    problems = gsm8k.load_problems(TEST_FILE)
    for row, problem in zip(rows, problems):
        assert gsm8k.score(row["answer"], problem["ground_truth"], "strict") == 1.0, row["answer"]
        assert gsm8k.score(row["answer"], problem["ground_truth"], "flexible") == 1.0


@pytest.mark.parametrize("response,strict,flexible", [
    ("The answer is 42", 0.0, 1.0),           # no '####': strict finds nothing
    ("The answer is 42.", 0.0, 0.1),          # verl keeps the trailing '.': "42." != "42"
    ("#### 41", 0.1, 0.1),                    # wrong number: format score
    ("####42", 0.0, 1.0),                     # no space after ####
    ("#### 1,042", 0.1, 0.1),                 # commas removed: 1042 != 42, a well-formed wrong answer
    ("first #### 7 then #### 42", 1.0, 1.0),  # the last one counts
    ("#### 42" + "x" * 400, 0.0, 0.0),        # answer outside the last 300 chars
    ("", 0.0, 0.0),
])
def test_bad_and_tricky_responses(response, strict, flexible):
    assert gsm8k.score(response, "42", "strict", format_score=0.1) == strict
    assert gsm8k.score(response, "42", "flexible", format_score=0.1) == flexible


def test_prompt_and_synthetic_problems():
    messages = gsm8k.build_prompt("What is 2+3?")
    assert messages == [{"role": "user", "content":
                         'What is 2+3? Let\'s think step by step and output the final answer after "####".'}]
    problems = arithmetic.load_problems("mixed", seed=3)
    assert problems == arithmetic.load_problems("mixed", seed=3) != arithmetic.load_problems("mixed", seed=4)
    sums = arithmetic.load_problems("sums", split="val")
    assert len(sums) == 9 and sums == arithmetic.load_problems("sums", split="train", seed=5)
    for p in problems + sums:
        assert str(eval(p["question"][8:-1])) == p["ground_truth"]
    with pytest.raises(ValueError, match="openai/gsm8k is no problem set of the arithmetic task; use sums or mixed"):
        arithmetic.load_problems("openai/gsm8k")


def test_verl_parquet_schema(tmp_path):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "train.parquet"
    pd.DataFrame([{"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "18"},
                   "extra_info": {"question": "What is 9+9?", "answer": "#### 18"}}]).to_parquet(path)
    assert gsm8k.load_problems(str(path)) == [{"question": "What is 9+9?", "ground_truth": "18"}]


@pytest.mark.parametrize("content,message", [
    ("", "has no rows"),
    ('{"question": "q", "answer": "#### 1"}\n{"question": \n', "line 2 is not JSON"),
    ('{"prompt": "q", "answer": "#### 1"}\n', "row 1 has neither question/answer"),
])
def test_bad_data_file_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{path}.*{message}"):
        gsm8k.load_problems(str(path))


def test_missing_data_file(tmp_path):
    with pytest.raises(ValueError, match="no.jsonl does not exist"):
        gsm8k.load_problems(str(tmp_path / "no.jsonl"))


def test_parquet_of_another_schema(tmp_path):
    import pandas as pd

    path = tmp_path / "other.parquet"
    pd.DataFrame({"text": ["a"], "label": [1]}).to_parquet(path)
    with pytest.raises(ValueError, match=r"row 1 has neither .* its keys: \['label', 'text'\]"):
        gsm8k.load_problems(str(path))


def test_a_hub_dataset_gives_its_test_split_for_validation(monkeypatch):
    """data.val_files naming a hub dataset loads its test split, data.train_files its train split."""
    splits = []

    def load_dataset(name, config, split):
        splits.append(split)
        return [{"question": "What is 1+1?", "answer": "#### 2"}]

    monkeypatch.setitem(sys.modules, "datasets", SimpleNamespace(load_dataset=load_dataset))
    assert gsm8k.load_problems("openai/gsm8k", split="val") == [{"question": "What is 1+1?", "ground_truth": "2"}]
    gsm8k.load_problems("openai/gsm8k", split="train")
    assert splits == ["test", "train"]
