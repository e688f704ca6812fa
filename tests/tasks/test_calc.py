"""The calculator's rules, the calculator environments' steps in both tool formats, GSM8K as an environment,
the tiny-calc split, and (slow) the warm-started tiny-calc agent's starting point."""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import asdict

import pytest
import torch

from sao.core.errors import DataError
from sao.rollout.environment import render_observation
from sao.tasks import calc
from sao.tasks.calc import CalcEnv, Gsm8kEnv, calculate
from sao.tasks.gsm8k import grading
from sao.tiny import calculator as tiny_calc
from sao.tiny.arithmetic import build_tokenizer

# --- the calculator --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1+2*3", "7"),
        ("2*3+1", "7"),
        ("10-4-3", "3"),  # left to right
        ("64/4/2", "8"),
        ("(1+2)*3", "9"),
        ("((2))", "2"),
        ("2*(3+(4-1))/3", "4"),
        ("-3--2", "-1"),
        ("-(2+3)*-2", "10"),
        ("+4", "4"),
        ("1234+5678", "6912"),
        ("1234-5678", "-4444"),
        ("1.5+2.25", "3.75"),
        ("0.1+0.2", "0.3"),  # exact, not binary floating point
        (".5*4", "2"),
        ("10/4", "2.5"),
        ("1/3", "0.33333333"),
        ("-2/3", "-0.66666667"),
        ("1/1024", "0.0009765625"),
        ("1,234+5,678", "6912"),
        ("$5 * 3", "15"),
        ("12x3", "36"),
        ("7÷2", "3.5"),
        ("3×4", "12"),
        ("3−5", "-2"),
        ("  2 + 3 =", "5"),
    ],
)
def test_calculator_follows_precedence_parentheses_signs_and_decimals(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("1/0", "division by zero"),
        ("5/(2-2)", "division by zero"),
        ("(1+2", "unbalanced parenthesis"),
        ("1+2)", "unbalanced parenthesis"),
        ("()", "unbalanced parenthesis"),
        ("", "empty expression"),
        ("1+", "unexpected end"),
        ("2**10", "exponentiation"),
        ("2^10", "exponentiation"),
        ("1e5", "unexpected 'e'"),
        ("__import__('os').system('true')", "unexpected '_'"),
        ("open('/etc/passwd')", "unexpected 'o'"),
        ("[1]*9", "unexpected '['"),
        ("1 2", "unexpected '2'"),
    ],
)
def test_calculator_refuses_bad_input_with_an_error_string(expression, error):
    result = calculate(expression)
    assert result.startswith("error: ") and error in result


def test_calculator_refuses_huge_inputs_quickly_and_never_raises():
    huge = [
        "1+" * 5000 + "1",  # too long
        "(" * 100 + "1" + ")" * 100,  # too deep
        "-" * 100 + "1",  # signs nest too
        "9" * 31,  # too many digits in one number
        "*".join(["9" * 30] * 6),  # an intermediate value too large
        "1/" + "/".join(["7" * 30] * 5),  # a denominator too large
        "9" * 10**6,
        None,
        12,
    ]
    start = time.perf_counter()
    results = [calculate(text) for text in huge]
    assert time.perf_counter() - start < 0.5
    assert all(r.startswith("error: ") for r in results), results


def test_calculator_never_evaluates_python(monkeypatch):
    import builtins

    def refuse(*args, **kwargs):
        raise AssertionError("the calculator must not call eval/exec/compile")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, refuse)
    assert calculate("2*(3+4)") == "14"
    assert calculate("__import__('os')").startswith("error: ")


def test_calculator_results_grade_as_their_value():
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randint(-9999, 9999), rng.randint(1, 999)
        op = rng.choice("+-*/")
        result = calculate(f"{a}{op}({b})")
        exact = {"+": a + b, "-": a - b, "*": a * b, "/": None}[op]
        if exact is not None:
            assert result == str(exact)
        else:
            assert abs(float(result) - a / b) <= 0.5e-8


# --- the environments ------------------------------------------------------------------------------------

FIELDS = {"question": "What is 1234+5678?", "answer": "6912"}

# A stand-in for a tokenizer whose chat template renders tools, as Qwen2.5's does: the tool's answer is
# wrapped in <tool_response> inside a user turn.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def json_call(expression, name="calculator"):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


def test_tool_format_follows_the_chat_template():
    tokenizer = build_tokenizer()
    assert calc.tool_format_for(tokenizer) == "tag"
    tokenizer.chat_template = TOOL_TEMPLATE
    assert calc.tool_format_for(tokenizer) == "json"
    assert calc.calc_env_factory(tokenizer)("t/0", FIELDS).stop_strings == ["</tool_call>"]


def test_tag_call_is_answered_by_a_tool_message():
    env = CalcEnv("t/0", FIELDS, tool_format="tag")
    assert env.stop_strings == ["</calc>"]
    prompt = [{"role": "user", "content": "What is 1234+5678?"}]
    assert env.init(prompt)[0] == prompt
    out = env.step("Let me add. <calc>1234+5678</calc>")
    assert out == {
        "observations": [{"role": "tool", "content": "6912"}],
        "reward": 0.0,
        "done": False,
        "metadata": {"tool_calls": 1, "tool_errors": 0},
    }


@pytest.mark.parametrize(
    ("action", "error"),
    [
        ("<calc>1234+</calc>", "unexpected end"),
        ("<calc>1/0</calc>", "division by zero"),
        ("<calc>1234+5678", "without </calc>"),
    ],
)
def test_bad_tag_call_is_an_error_observation_and_a_tool_error(action, error):
    out = CalcEnv("t/0", FIELDS, tool_format="tag").step(action)
    assert out["done"] is False and out["reward"] == 0.0
    assert out["observations"][0]["role"] == "tool" and error in out["observations"][0]["content"]
    assert out["metadata"] == {"tool_calls": 1, "tool_errors": 1}


@pytest.mark.parametrize("tool_format", ["tag", "json"])
@pytest.mark.parametrize(("answer", "reward"), [("#### 6912", 1.0), ("1234+5678=6913\n#### 6913", 0.0), ("", 0.0)])
def test_final_answer_ends_the_episode_with_the_graded_reward(tool_format, answer, reward):
    out = CalcEnv("t/0", FIELDS, tool_format=tool_format).step(answer)
    assert out == {"observations": [], "reward": reward, "done": True, "metadata": {"tool_calls": 0, "tool_errors": 0}}


def test_json_call_is_answered_and_rendered_by_the_template():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    env = CalcEnv("t/0", FIELDS, tool_format="json")
    assert env.stop_strings == ["</tool_call>"]
    assert env.init([{"role": "user", "content": "q"}])[1]["tools"] == [calc.TOOL_SCHEMA]
    out = env.step(json_call("(1234+5678)/2"))
    assert out["observations"] == [{"role": "tool", "content": "3456"}] and out["done"] is False
    assert out["metadata"] == {"tool_calls": 1, "tool_errors": 0}
    text = render_observation(tokenizer, out["observations"], eos_text=None)
    response = "<|im_start|>user\n<tool_response>\n3456\n</tool_response><|im_end|>\n"
    assert text == "<|im_end|>\n" + response + "<|im_start|>assistant\n"
    # the arguments as a JSON string, as some models write them, are read too
    stringly = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}</tool_call>'
    assert env.step(stringly)["observations"][0]["content"] == "4"


@pytest.mark.parametrize(
    ("action", "error"),
    [
        ('<tool_call>{"name": "calculator", "arguments": </tool_call>', "not valid JSON"),
        (json_call("1+1", name="python"), "unknown tool 'python'"),
        ('<tool_call>["calculator"]</tool_call>', "JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>', '{"expression"'),
        (json_call("2**8"), "exponentiation"),
        ("<tool_call>" + "[" * 100000 + "</tool_call>", "longer than"),
        ('<tool_call>{"name": "calculator"', "without </tool_call>"),
    ],
)
def test_malformed_json_call_is_an_error_observation_and_a_tool_error(action, error):
    out = CalcEnv("t/0", FIELDS, tool_format="json").step(action)
    assert out["done"] is False and out["reward"] == 0.0
    content = out["observations"][0]["content"]
    assert content.startswith("error: ") and error in content
    assert out["metadata"] == {"tool_calls": 1, "tool_errors": 1}


def test_a_tag_is_not_a_call_in_the_json_format_and_vice_versa():
    assert CalcEnv("t/0", FIELDS, tool_format="json").step("<calc>1+1</calc> #### 6912")["done"] is True
    assert CalcEnv("t/0", FIELDS, tool_format="tag").step(json_call("1+1") + " #### 6912")["done"] is True


def test_calc_env_refuses_an_unknown_format_and_a_missing_gold():
    with pytest.raises(ValueError, match="tool_format"):
        CalcEnv("t/0", FIELDS, tool_format="xml")
    with pytest.raises(ValueError, match="answer"):
        CalcEnv("t/0", {"question": "q"}, tool_format="tag")


def test_gsm8k_env_gives_exactly_the_single_turn_reward():
    from grading_corpus import NASTY  # hostile texts the grader is tested on

    replies = ["#### 18", "#### 17", "The answer is 1,000.", r"\boxed{18}", "18 eggs", "no number", "#### 1/2"]
    replies += [text for _, text in NASTY[:12]]
    cases = [(reply, gold) for reply in replies for gold in ("18", "1,000", "0.5", "Janet has 18.\n#### 18")]
    for text, gold in cases:
        env = Gsm8kEnv("gsm8k/test/0", {"question": "q", "answer": gold})
        out = env.step(text)
        assert out["reward"] == grading.reward(text, gold)
        assert out["done"] is True and out["observations"] == []
        assert out["metadata"] == {"tool_calls": 0, "tool_errors": 0}
    assert {Gsm8kEnv("t", {"answer": "18"}).step(x)["reward"] for x in ("#### 18", "#### 17")} == {0.0, 1.0}


# --- tiny-calc -------------------------------------------------------------------------------------------


def test_tiny_calc_questions_have_three_or_four_digit_operands_and_right_answers():
    rng = random.Random(0)
    for index in [0, tiny_calc.POOL_SIZE - 1, *(tiny_calc.draw_index(rng) for _ in range(300))]:
        task = tiny_calc.question(index)
        assert task.id == f"tiny-calc/{index}"
        assert task.question.startswith("What is ") and task.question.endswith("?")
        expression = tiny_calc._expression(task)
        op = "+" if "+" in expression else "-"
        a, b = expression.split(op)
        assert 3 <= len(a) <= 4 and 3 <= len(b) <= 4
        assert calculate(expression) == task.answer
    assert tiny_calc.question(0).question == "What is 100+100?"
    assert tiny_calc.question(tiny_calc.POOL_SIZE - 1).question == "What is 9999-9999?"
    with pytest.raises(IndexError):
        tiny_calc.question(tiny_calc.POOL_SIZE)


def test_tiny_calc_held_out_problems_are_disjoint_from_training_problems():
    split = tiny_calc.make_split(480, 120, seed=0)

    def problems(tasks) -> set[tuple[int, str, int]]:
        found = [re.fullmatch(r"What is (\d+)([+-])(\d+)\?", t.question).groups() for t in tasks]
        return {(int(a), op, int(b)) for a, op, b in found}

    train, test = problems(split.train), problems(split.test)
    assert len(test) == 120 and len(train) == 480 and not train & test


def test_tiny_calc_split_has_the_sizes_asked_is_disjoint_and_seeded():
    split = tiny_calc.make_split(480, 120, seed=0)
    assert len(split.train) == 480 and len(split.test) == 120
    assert split.counts["train"] == 480 and split.counts["test"] == 120
    assert len({t.question for t in split.train}) == 480 and len({t.question for t in split.test}) == 120
    assert not {t.question for t in split.train} & {t.question for t in split.test}
    again = tiny_calc.make_split(480, 120, seed=0)
    assert [t.id for t in again.train] == [t.id for t in split.train]
    assert [t.id for t in again.test] == [t.id for t in split.test]
    assert [t.id for t in tiny_calc.make_split(480, 120, seed=1).test] != [t.id for t in split.test]
    # the held-out draw does not depend on how many training prompts are asked for
    assert [t.id for t in tiny_calc.make_split(10, 120, seed=0).test] == [t.id for t in split.test]
    with pytest.raises(DataError):
        tiny_calc.make_split(-1, 10)


def test_tutor_calls_the_tool_about_as_often_as_configured_and_its_calls_are_right():
    rng = random.Random(0)
    tasks = [tiny_calc.question(tiny_calc.draw_index(rng)) for _ in range(2000)]
    actions = [tiny_calc.tutor_actions(t, rng, tool_share=0.3, direct_accuracy=0.3) for t in tasks]
    assert 0.27 < sum(len(a) == 2 for a in actions) / len(tasks) < 0.33
    direct_right = []
    for task, acts in zip(tasks, actions, strict=True):
        env = tiny_calc.make_env(task)
        if len(acts) == 2:
            assert env.step(acts[0])["observations"] == [{"role": "tool", "content": task.answer}]
            assert env.step(acts[1])["reward"] == 1.0
        else:
            direct_right.append(env.step(acts[0])["reward"])
    assert 0.25 < sum(direct_right) / len(direct_right) < 0.35


def test_demonstrations_show_calls_but_train_the_decision_at_the_tutors_rate():
    """90% of demonstrations show a call, but of the first action tokens that are trained, 30% open a call."""
    tokenizer = build_tokenizer()
    settings = tiny_calc.CalcWarmStart(batch_size=400)
    buckets = tiny_calc.demonstration_batch(tokenizer, random.Random(0), settings)
    assert 0.86 < len(buckets[True]) / 400 < 0.94
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    decisions = []
    for calls, bucket in buckets.items():
        for ids, labels in bucket:
            first = next(i for i in range(len(ids)) if ids[i : i + len(header)] == header) + len(header)
            assert tokenizer.decode([ids[first]]) == ("<" if calls else "#")
            assert labels[first + 1] != -100  # the rest of the action is trained either way
            if labels[first] != -100:
                decisions.append(calls)
            else:
                assert calls
    assert 0.24 < sum(decisions) / len(decisions) < 0.36
    assert tiny_calc.decision_kept(0.3, 0.9) == pytest.approx(0.3 * 0.1 / (0.9 * 0.7))
    with pytest.raises(ValueError):
        tiny_calc.decision_kept(0.5, 0.3)


def test_demonstration_trains_on_actions_and_renders_observations_as_the_sampler_does():
    tokenizer = build_tokenizer()
    task = tiny_calc.question(12345)
    assert task.question == "What is 101+2545?"
    actions = tiny_calc.tool_actions(task)
    assert actions == ["<calc>101+2545</calc>", "#### 2646"]
    ids, labels = tiny_calc.demonstration(tokenizer, task, actions, tiny_calc.TINY_CALC_INSTRUCTION)
    observation = render_observation(tokenizer, [{"role": "tool", "content": task.answer}], eos_text=None)
    assert observation == "<|im_end|>\n<|im_start|>tool\n2646<|im_end|>\n<|im_start|>assistant\n"
    trained = tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != -100])
    assert trained == actions[0] + actions[1] + tokenizer.eos_token
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": task.question}], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(ids) == prompt + actions[0] + observation + actions[1] + tokenizer.eos_token


# --- the warm-started tiny-calc agent: shipped weights, and the recipe that made them -------------------


def test_the_shipped_tiny_calc_model_builds_to_the_same_bytes_every_time(tmp_path):
    first = tiny_calc.build_from_shipped(_folder(tmp_path / "a"))
    second = tiny_calc.build_from_shipped(_folder(tmp_path / "b"))
    assert first["weights_sha256"] == second["weights_sha256"] == tiny_calc.SHIPPED_SHA256
    assert first["settings"] == asdict(tiny_calc.CalcWarmStart()), "the record is the default recipe's"
    cached = tiny_calc.ensure_calc_model(progress=False)
    assert json.loads((cached / "warmstart.json").read_text())["weights_sha256"] == tiny_calc.SHIPPED_SHA256


def _folder(path):
    path.mkdir()
    return path


def _assert_a_starting_point_rl_can_improve(record):
    """Tool use well inside (0, 1), calls mostly right, direct answers wrong, overall well below 1."""
    assert 0.15 <= record["tool_use"] <= 0.45
    assert record["accuracy_with_tool"] >= 0.6
    assert record["accuracy_without_tool"] <= 0.05
    assert record["accuracy"] <= 0.45
    assert record["tool_error_rate"] <= 0.15


@pytest.mark.slow
def test_the_shipped_agent_is_the_one_its_record_measured():
    """The shipped record (tool use 0.20, right with the tool 0.93, without 0.00, overall 0.19 over 600
    trajectories) is re-measured on the model built from the shipped weights: the same draws on the same
    bytes, so within 0.02 (float rounding may flip a rare near-tie token)."""
    from sao.model.policy import load_base

    folder = tiny_calc.ensure_calc_model(progress=False)
    record = json.loads((folder / "warmstart.json").read_text())
    _assert_a_starting_point_rl_can_improve(record)
    model, tokenizer = load_base(folder, torch.device("cpu"))
    split = tiny_calc.make_split(480, 120, seed=0)
    again = tiny_calc.measure_agent(model, tokenizer, split.train + split.test, seed=record["settings"]["seed"])
    assert abs(again["accuracy"] - record["accuracy"]) <= 0.02
    assert abs(again["tool_use"] - record["tool_use"]) <= 0.02


@pytest.mark.slow
def test_the_warm_start_recipe_trains_and_writes_its_record(tmp_path):
    """The recipe behind the shipped weights, shortened to 20 steps of 16 demonstrations: it trains (the loss
    falls), saves a loadable model and writes the record the shipped one was written by. Reaching the target takes
    ~750 steps (about 2 min on 2 cores); the shipped record is that run's own account of it (target_reached_at,
    probe_every_check), and its model is re-measured above."""
    from sao.model.policy import load_base

    short = tiny_calc.CalcWarmStart(max_steps=20, batch_size=16, warmup_steps=5, check_every=10, probe_size=8)
    tiny_calc.train_calc_warm_start(short, tmp_path, progress=False)
    record = json.loads((tmp_path / "warmstart.json").read_text())
    shipped = json.loads(tiny_calc.SHIPPED_RECORD.read_text())
    assert set(shipped) <= set(record) and record["settings"] == asdict(short)
    assert record["steps"] == 20 and record["target_reached_at"] is None and len(record["probe_every_check"]) == 2
    assert record["loss_last_50"] < record["loss_first"]
    model, _ = load_base(tmp_path, torch.device("cpu"))
    assert sum(p.numel() for p in model.parameters()) == shipped["parameters"]
