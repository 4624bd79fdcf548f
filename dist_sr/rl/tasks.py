"""Verifiable-reward tasks: generated ones (digit reversal, addition, addition asked in a
pretrained model's own chat format), datasets from files, and reasoning-gym's procedural datasets
asked in a chat model's template and scored by their own verifiers.

A task yields ``Example(prompt, answer)`` for training (``sample``) and for evaluation
(``sample_eval``: a held-out split where the task has one) and scores a completion against an
example (``score``, in [0, 1]; 1 is solved).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..config import ConfigError


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    # the source's own record of the example (reasoning-gym's entry: what its verifier reads)
    entry: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)


class Task:
    name = "task"

    def sample(self, rng: random.Random) -> Example:
        """A training example."""
        raise NotImplementedError

    def sample_eval(self, rng: random.Random) -> Example:
        """An evaluation example: from the held-out split where the task has one, else drawn like
        a training example."""
        return self.sample(rng)

    def extract(self, completion: str) -> str:
        """The answer a completion gives (what the reward compares)."""
        return completion.strip()

    def reward(self, completion: str, answer: str) -> float:
        return float(self.extract(completion) == answer)

    def score(self, completion: str, example: Example) -> float:
        """The reward of ``completion`` for ``example``, in [0, 1]; 1.0 counts as solved."""
        return self.reward(completion, example.answer)


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


_DECIMAL = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (an integer or a decimal; digit-group commas removed; a
    minus sign directly before it kept), or None when there is none."""
    found = _DECIMAL.findall(text)
    return found[-1].replace(",", "") if found else None


def held_out(question: str, seed: int, share: float) -> bool:
    """Whether ``question`` belongs to the evaluation split: a hash of the question's text and
    ``seed``, below ``share`` of its range. By the text, so a question generated twice (under two
    indices) lands in one split only: train and eval never share a question."""
    h = int.from_bytes(hashlib.blake2b(f"{seed}/{question}".encode(), digest_size=8).digest(), "little")
    return h < share * 2**64


RG_ANSWERS = ("last-number", "tag", "full")


class ReasoningGym(Task):
    """A dataset of ``reasoning-gym`` (procedural generators with their own verifiers, e.g.
    ``chain_sum``: "State the final answer to the following arithmetic problem: 4 - 1 ="), asked
    as one user turn in a chat model's template, no system prompt (``chat_prompt``).

    Reward: the dataset's own ``score_answer(answer, entry)`` on the answer the completion gives:
    ``answer="last-number"`` (default) its last number (``last_number``: a small chat model
    explains before it answers), ``"tag"`` the text inside reasoning-gym's ``<answer>`` tags,
    ``"full"`` the whole completion, stripped. The verifier may give partial credit (chain_sum's
    for a wrong number that contains the answer); 1.0 is solved.

    Split: the generator (``seed``, ``size`` indices, ``params`` its config) is shared, and each
    question goes to evaluation or training by a hash of its text (``held_out``, ``eval_share`` of
    the questions), so the two never share a question. ``sample`` draws training questions,
    ``sample_eval`` held-out ones, each by index with ``rng``.
    """

    name = "reasoning-gym"

    def __init__(
        self,
        dataset: str,
        *,
        tokenizer,
        params: dict | None = None,
        seed: int = 0,
        size: int = 100_000,
        eval_share: float = 0.25,
        answer: str = "last-number",
    ):
        try:
            import reasoning_gym
        except ImportError:
            raise ConfigError(
                "task.name reasoning-gym needs the reasoning-gym package: bash scripts/setup.sh rl (it is in "
                "the rl extra)"
            ) from None
        if answer not in RG_ANSWERS:
            raise ConfigError(f"task.gym.answer must be one of {', '.join(RG_ANSWERS)}, got {answer!r}")
        if not 0 < eval_share < 1:
            raise ConfigError(
                f"task.gym.eval_share must be in (0, 1) (the share of questions held out), got {eval_share}"
            )
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat template; task.name reasoning-gym asks in a chat model's own")
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            raise ConfigError(
                f"task.gym.dataset: reasoning-gym has no dataset {dataset!r}; choose one of "
                f"{', '.join(sorted(DATASETS))}"
            )
        try:
            self.data = reasoning_gym.create_dataset(dataset, seed=seed, size=size, **(params or {}))
        except (TypeError, ValueError, AssertionError) as exc:
            raise ConfigError(
                f"task.gym.params {params!r}: reasoning-gym's {dataset} refused them ({exc}); give fields of its config"
            ) from None
        self.dataset, self.seed, self.size, self.eval_share = dataset, seed, size, eval_share
        self.tokenizer, self.answer = tokenizer, answer

    def _draw(self, rng: random.Random, evaluation: bool) -> Example:
        for _ in range(100_000):
            entry = self.data[rng.randrange(self.size)]
            if held_out(entry["question"], self.seed, self.eval_share) == evaluation:
                return Example(chat_prompt(self.tokenizer, entry["question"]), str(entry["answer"]), entry)
        split = "evaluation" if evaluation else "training"
        raise ConfigError(
            f"reasoning-gym {self.dataset!r}: no {split} question in 100000 draws; raise task.gym.size or "
            "move task.gym.eval_share away from 0 and 1"
        )

    def sample(self, rng: random.Random) -> Example:
        return self._draw(rng, evaluation=False)

    def sample_eval(self, rng: random.Random) -> Example:
        return self._draw(rng, evaluation=True)

    def extract(self, completion: str) -> str:
        if self.answer == "last-number":
            return last_number(completion) or ""
        if self.answer == "tag":
            from reasoning_gym.utils import extract_answer

            return extract_answer(completion) or ""
        return completion.strip()

    def score(self, completion: str, example: Example) -> float:
        return float(self.data.score_answer(self.extract(completion), example.entry))

    def reward(self, completion: str, answer: str) -> float:
        raise TypeError("a reasoning-gym task scores against the example's entry: call score(completion, example)")


TASKS = {
    "reverse": ReverseDigits,
    "add": Addition,
    "dataset": DatasetTask,
    "chat-add": ChatArithmetic,
    "reasoning-gym": ReasoningGym,
}
