"""Rewards on known answers, GSM8K-style extraction, and datasets loaded from local files."""

import json
import random

import pytest

from dist_sr.rl.tasks import Addition, DatasetTask, ReverseDigits, gsm8k_answer


def test_reverse_task_and_reward():
    task = ReverseDigits(5)
    ex = task.sample(random.Random(0))
    assert len(ex.prompt) == 6 and ex.prompt.endswith("=") and ex.answer == ex.prompt[:-1][::-1]
    assert task.reward(ex.answer, ex.answer) == 1.0
    assert task.reward(task.distractor(ex), ex.answer) == float(ex.prompt[:-1] == ex.answer)
    assert task.reward("", ex.answer) == 0.0


def test_addition_task_and_reward():
    task = Addition(3)
    rng = random.Random(1)
    for _ in range(50):
        ex = task.sample(rng)
        a, b = ex.prompt[:-1].split("+")
        assert ex.answer == str(int(a) + int(b))
        assert task.reward(ex.answer, ex.answer) == 1.0 and task.reward(task.distractor(ex), ex.answer) == 0.0


@pytest.mark.parametrize(
    "text,answer",
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("so the total is 1,234 dollars #### 1,234", "1234"),
        ("The answer is 15.", "15"),
        ("#### -7", "-7"),
        ("it costs 3.0", "3"),
        ("no number here", "no number here"),
    ],
)
def test_gsm8k_answer_extraction(text, answer):
    assert gsm8k_answer(text) == answer


ROWS = [
    {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"},
    {"question": "Tom has 3 apples and buys 5 more.", "answer": "3+5=8\n#### 8"},
]


def test_dataset_task_from_local_jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    task = DatasetTask(str(path))
    assert [e.answer for e in task.examples] == ["4", "8"]
    ex = task.sample(random.Random(0))
    assert ex in task.examples
    assert task.reward("First 3+5=8. #### 8", "8") == 1.0
    assert task.reward("I think it is 9", "8") == 0.0


def test_dataset_task_from_local_parquet(tmp_path):
    import datasets

    path = tmp_path / "test.parquet"
    datasets.Dataset.from_list([{"prompt": r["question"], "target": "42"} for r in ROWS]).to_parquet(str(path))
    task = DatasetTask(str(path), split="test", prompt_field="prompt", answer_field="target", answer_format="plain")
    assert [e.answer for e in task.examples] == ["42", "42"]


def test_dataset_with_missing_field_is_a_clear_error(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"q": "x", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="has no field 'question'"):
        DatasetTask(str(path))
