"""Verifiable-reward tasks: generated ones (digit reversal, addition, addition asked in a
pretrained model's own chat format) and datasets from files.

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


_INTEGER = re.compile(r"-?\d+(?:,\d{3})*")


def last_integer(text: str) -> str | None:
    """The last integer written in ``text`` (digit-group commas removed: ``1,234`` is ``1234``;
    a minus sign directly before it kept), or None when there is none."""
    found = _INTEGER.findall(text)
    return found[-1].replace(",", "") if found else None


def chat_prompt(tokenizer, message: str) -> str:
    """``message`` as one user turn in the tokenizer's own chat template, ending with the
    template's generation prompt. A system turn the template adds when none is given (SmolLM2's
    "You are a helpful AI assistant named SmolLM...") is left out: the model is asked in its own
    format, and prompts stay short."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; the chat task needs a chat model's tokenizer")
    user = {"role": "user", "content": message}
    plain = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    system = {"role": "system", "content": ""}
    empty = tokenizer.apply_chat_template([system], tokenize=False)
    both = tokenizer.apply_chat_template([system, user], tokenize=False, add_generation_prompt=True)
    # the user turn as the template writes it after a system turn; the same text ends ``plain``
    # when the template's default system turn is a prefix of it
    turn = both[len(empty) :] if both.startswith(empty) else plain
    return turn if plain.endswith(turn) else plain


class ChatArithmetic(Task):
    """Addition asked in a chat model's own language: ``question`` (default "What is {a} + {b}?")
    as one user turn in its chat template, no system prompt (about 25 tokens for SmolLM2).

    Operands: each has 1 to ``num_digits`` digits (the count drawn uniformly, then the value), so
    the prompts mix single-digit sums the model often gets right with harder ones it rarely does.

    Format rule (the reward): the answer is the **last integer** in the completion (digit-group
    commas removed); the reward is 1.0 when it equals ``a + b`` exactly, else 0.0. "The answer is
    12." and "5 + 7 = 12" score 1; "12 or 13" scores 0 (its last integer is 13); a completion cut
    off by ``grpo.max_new_tokens`` before it states the sum scores 0.
    """

    name = "chat-add"

    def __init__(self, num_digits: int = 2, *, tokenizer, question: str = "What is {a} + {b}?"):
        if num_digits < 1:
            raise ValueError("task.num_digits must be >= 1")
        if "{a}" not in question or "{b}" not in question:
            raise ValueError(f"task.question must contain {{a}} and {{b}}, got {question!r}")
        self.num_digits, self.tokenizer, self.question = num_digits, tokenizer, question

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.num_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def sample(self, rng: random.Random) -> Example:
        a, b = self._operand(rng), self._operand(rng)
        return Example(chat_prompt(self.tokenizer, self.question.format(a=a, b=b)), str(a + b))

    def extract(self, completion: str) -> str:
        return last_integer(completion) or ""


TASKS = {"reverse": ReverseDigits, "add": Addition, "dataset": DatasetTask, "chat-add": ChatArithmetic}
