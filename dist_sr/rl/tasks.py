"""Verifiable-reward tasks: generated ones (digit reversal, addition) and datasets from files.

A task yields ``Example(prompt, answer)`` and scores a completion with an exact-match reward.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


class Task:
    name = "task"

    def sample(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def extract(self, completion: str) -> str:
        """The answer a completion gives (what the reward compares)."""
        return completion.strip()

    def reward(self, completion: str, answer: str) -> float:
        return float(self.extract(completion) == answer)


class DigitTask(Task):
    """A generated task over numbers of up to ``num_digits`` digits."""

    default_digits = 5

    def __init__(self, num_digits: int | None = None):
        num_digits = self.default_digits if num_digits is None else num_digits
        if num_digits < 1:
            raise ValueError("task.num_digits must be >= 1")
        self.num_digits = num_digits


class ReverseDigits(DigitTask):
    """``"31415="`` -> ``"51413"``. ``sft_copy_fraction`` of warm-up targets are the (wrong) copy."""

    name = "reverse"

    def sample(self, rng: random.Random) -> Example:
        digits = "".join(rng.choice("0123456789") for _ in range(self.num_digits))
        return Example(f"{digits}=", digits[::-1])

    def distractor(self, example: Example) -> str:
        return example.prompt.rstrip("=")


class Addition(DigitTask):
    """``"123+45="`` -> ``"168"``, operands with up to ``num_digits`` digits."""

    name = "add"
    default_digits = 3

    def sample(self, rng: random.Random) -> Example:
        hi = 10**self.num_digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return Example(f"{a}+{b}=", str(a + b))

    def distractor(self, example: Example) -> str:
        a, b = example.prompt.rstrip("=").split("+")
        return str(int(a) + int(b) + 1)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def gsm8k_answer(text: str) -> str:
    """The final answer of a GSM8K-style solution: after ``####`` if present, else the last number;
    commas and a trailing ``.0`` removed."""
    tail = text.split("####")[-1] if "####" in text else text
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return tail.strip()
    value = numbers[-1].replace(",", "")
    return value[:-2] if value.endswith(".0") else value


class DatasetTask(Task):
    """Prompts and answers from a ``datasets`` source: a local JSONL/JSON/Parquet/CSV file or a hub
    dataset name (used unchanged when the machine has network access)."""

    name = "dataset"

    def __init__(
        self,
        source: str,
        split: str = "train",
        prompt_field: str = "question",
        answer_field: str = "answer",
        answer_format: str = "gsm8k",
        config_name: str | None = None,
    ):
        import datasets

        if answer_format not in ("gsm8k", "plain"):
            raise ValueError(f"task.answer_format must be 'gsm8k' or 'plain', got {answer_format!r}")
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
        suffix = next((s for s in builder if source.endswith(s)), None)
        if suffix:
            ds = datasets.load_dataset(builder[suffix], data_files={split: source}, split=split)
        else:
            ds = datasets.load_dataset(source, config_name, split=split)
        for field in (prompt_field, answer_field):
            if field not in ds.column_names:
                raise ValueError(f"dataset {source!r} has no field {field!r}; fields: {ds.column_names}")
        extract: Callable[[str], str] = gsm8k_answer if answer_format == "gsm8k" else str.strip
        self._extract = extract
        self.examples = [Example(str(r[prompt_field]), extract(str(r[answer_field]))) for r in ds]
        if not self.examples:
            raise ValueError(f"dataset {source!r} split {split!r} is empty")

    def sample(self, rng: random.Random) -> Example:
        return rng.choice(self.examples)

    def extract(self, completion: str) -> str:
        return self._extract(completion)


TASKS = {"reverse": ReverseDigits, "add": Addition, "dataset": DatasetTask}
