"""The chat arithmetic task: seeded prompts in the model's own chat template without a system
prompt, and an exact-match reward on the last integer of the completion (the format rule)."""

import random

import pytest

from dist_sr.rl.tasks import ChatArithmetic, chat_prompt, last_integer

# SmolLM2's template: a default system turn when the conversation has none
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    pytest.importorskip("gguf", reason="the gguf package (bash scripts/setup.sh rl smollm2 dev)")
    from dist_sr.rl.checkpoint import load_source, resolve

    from .gguf_files import tiny_llama, write_gguf

    path = write_gguf(tiny_llama(), tmp_path_factory.mktemp("tok") / "tiny.gguf")
    return load_source(resolve(path))[1]


@pytest.mark.parametrize(
    "text, want",
    [
        ("12", "12"),
        ("The answer is 12.", "12"),
        ("5 + 7 = 12", "12"),
        ("12 or 13", "13"),
        ("It is 1,234 in all", "1234"),
        ("-3", "-3"),
        ("3 - 5 is -2", "-2"),
        ("no number", None),
        ("", None),
    ],
)
def test_the_answer_is_the_last_integer_of_the_completion(text, want):
    assert last_integer(text) == want


def test_the_reward_is_exact_match_of_the_last_integer(tokenizer):
    task = ChatArithmetic(1, tokenizer=tokenizer)
    assert task.reward("The answer is 12.", "12") == 1.0
    assert task.reward("5 + 7 = 12\n\nThat is all.", "12") == 1.0
    assert task.reward("12 or 13", "12") == 0.0  # the last integer counts
    assert task.reward("To find the sum of 5 and 7, we", "12") == 0.0  # cut off before the sum
    assert task.reward("", "12") == 0.0 and task.reward("120", "12") == 0.0


def test_prompts_are_seeded_one_user_turn_in_the_model_template_with_right_answers(tokenizer):
    task = ChatArithmetic(2, tokenizer=tokenizer, question="What is {a} + {b}? Answer with the number only.")
    a = [task.sample(random.Random(7)) for _ in range(3)]
    b = [task.sample(random.Random(7)) for _ in range(3)]
    assert a == b
    rng = random.Random(0)
    digits = set()
    for _ in range(200):
        ex = task.sample(rng)
        assert ex.prompt.startswith("<|im_start|>user\nWhat is ") and ex.prompt.endswith("<|im_start|>assistant\n")
        x, y = ex.prompt.split("What is ")[1].split("?")[0].split(" + ")
        assert ex.answer == str(int(x) + int(y)) and task.reward(ex.answer, ex.answer) == 1.0
        digits |= {len(x), len(y)}
    assert digits == {1, 2}  # a mix of one- and two-digit operands


def test_a_default_system_turn_of_the_template_is_left_out(tokenizer):
    tokenizer.chat_template, saved = SMOLLM2_TEMPLATE, tokenizer.chat_template
    try:
        full = tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 1 + 2?"}], tokenize=False, add_generation_prompt=True
        )
        assert "SmolLM" in full  # what the template writes on its own
        assert chat_prompt(tokenizer, "What is 1 + 2?") == (
            "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
        )
    finally:
        tokenizer.chat_template = saved


def test_the_chat_task_without_a_chat_model_is_refused():
    from dist_sr.config import ConfigError
    from dist_sr.rl.config import load_experiment
    from dist_sr.rl.warmup import make_task

    cfg = load_experiment({"task": {"name": "chat-add", "num_digits": 1}})
    with pytest.raises(ConfigError, match="model.path"):
        make_task(cfg)
    with pytest.raises(ConfigError, match="task.question"):
        load_experiment({"task": {"name": "chat-add", "question": "What is {a}?"}})
