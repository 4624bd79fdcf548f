"""reasoning-gym as a task source: its questions in the model's chat template, its own verifier as
the reward, and a seeded train/eval split by question that never overlaps."""

import random

import pytest

from dist_sr.config import ConfigError
from dist_sr.rl.config import load_experiment
from dist_sr.rl.evaluation import fixed_examples
from dist_sr.rl.tasks import ReasoningGym, held_out, last_number

rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym (bash scripts/setup.sh rl)")

CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 200 distinct questions


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    pytest.importorskip("gguf", reason="the gguf package (bash scripts/setup.sh rl smollm2 dev)")
    from dist_sr.rl.checkpoint import load_source, resolve

    from .gguf_files import tiny_llama, write_gguf

    path = write_gguf(tiny_llama(), tmp_path_factory.mktemp("tok") / "tiny.gguf")
    return load_source(resolve(path))[1]


def chain_sum(tokenizer, **kw):
    return ReasoningGym("chain_sum", tokenizer=tokenizer, params=CHAIN_SUM, **kw)


def question(example) -> str:
    return example.entry["question"]


def test_train_and_eval_never_share_a_question_even_where_the_generator_repeats_one(tokenizer):
    task = chain_sum(tokenizer)
    rng = random.Random(0)
    train = [task.sample(rng) for _ in range(2000)]
    evals = [task.sample_eval(rng) for _ in range(500)]
    train_q, eval_q = {question(e) for e in train}, {question(e) for e in evals}
    assert len(train) > len(train_q)  # the generator repeats questions under other indices
    assert train_q and eval_q and not train_q & eval_q
    share = len(eval_q) / len(train_q | eval_q)
    assert 0.15 < share < 0.35  # about eval_share (0.25) of the 200 questions
    assert all(held_out(q, 0, 0.25) for q in eval_q) and not any(held_out(q, 0, 0.25) for q in train_q)


def test_evaluation_prompts_come_from_the_held_out_split_and_are_seeded(tokenizer):
    task = chain_sum(tokenizer)
    a, b = fixed_examples(task, 64, seed=1234), fixed_examples(task, 64, seed=1234)
    assert [e.prompt for e in a] == [e.prompt for e in b]
    assert all(held_out(question(e), 0, 0.25) for e in a)
    other = chain_sum(tokenizer, seed=1)  # another generator seed: another split and other draws
    assert {question(e) for e in fixed_examples(other, 64, seed=1234)} != {question(e) for e in a}


def test_prompts_are_the_datasets_question_as_one_user_turn_of_the_chat_template(tokenizer):
    ex = chain_sum(tokenizer).sample(random.Random(3))
    assert ex.prompt == f"<|im_start|>user\n{question(ex)}<|im_end|>\n<|im_start|>assistant\n"
    assert question(ex).startswith("State the final answer to the following arithmetic problem: ")
    assert ex.answer == ex.entry["answer"]


@pytest.mark.parametrize(
    "text, want",
    [("7", "7"), ("The answer is -3.", "-3"), ("2.5 and then 1,234", "1234"), ("1.50", "1.50"), ("none", None)],
)
def test_the_answer_of_a_completion_is_its_last_number(text, want):
    assert last_number(text) == want


def test_the_reward_is_the_datasets_own_score_answer_on_the_extracted_answer(tokenizer):
    task = chain_sum(tokenizer)
    ex = task.sample(random.Random(5))
    right, ds = ex.answer, task.data
    assert task.score(f"The final answer is {right}.", ex) == 1.0 == ds.score_answer(right, ex.entry)
    wrong = str(int(right) + 1)
    assert task.score(f"It is {right} or {wrong}", ex) == ds.score_answer(wrong, ex.entry) < 1.0
    assert task.score("I cannot say", ex) == 0.0
    full = chain_sum(tokenizer, answer="full")  # the whole completion: the verifier's partial credit
    text = f"The final answer is {right}"
    assert full.score(text, ex) == ds.score_answer(text, ex.entry) == pytest.approx(len(right) / len(text))
    tag = chain_sum(tokenizer, answer="tag")  # reasoning-gym's own <answer> tags
    assert tag.score(f"thinking 9 <answer>{right}</answer>", ex) == 1.0 and tag.score(right, ex) == 0.0


def test_the_reasoning_gym_config_is_checked_when_loaded():
    cfg = load_experiment({"task": {"name": "reasoning-gym", "gym": {"dataset": "chain_sum", "params": CHAIN_SUM}}})
    assert cfg.task.gym.dataset == "chain_sum" and cfg.task.gym.params == CHAIN_SUM
    assert load_experiment({"task": {"name": "reasoning-gym"}}).task.gym.dataset == "chain_sum"
    for task, match in (
        ({"name": "chat-add", "gym": {}}, "task.gym is for task.name reasoning-gym"),
        ({"name": "reasoning-gym", "gym": {"eval_share": 1.0}}, "task.gym.eval_share must be in"),
        ({"name": "reasoning-gym", "gym": {"answer": "first"}}, "task.gym.answer: choose one of"),
        ({"name": "reasoning-gym", "gym": {"params": [1]}}, "task.gym.params must be a mapping"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_experiment({"task": task})


def test_an_unknown_dataset_or_config_field_is_refused_naming_the_field(tokenizer):
    with pytest.raises(ConfigError, match="task.gym.dataset"):
        ReasoningGym("no_such_dataset", tokenizer=tokenizer)
    with pytest.raises(ConfigError, match="task.gym.params"):
        ReasoningGym("chain_sum", tokenizer=tokenizer, params={"digits": 3})


def test_a_tiny_models_warm_up_cache_keeps_its_name():
    """task.gym and warmup.pretrained came after the cached warm-ups were named: unset, they leave
    the name as it was (this value is the default experiment's key before they existed)."""
    from dist_sr.rl.warmup import cache_key

    assert cache_key(load_experiment({}), "cpu") == "b106b30bb7139082"
