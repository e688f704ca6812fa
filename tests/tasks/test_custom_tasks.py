"""sao.tasks.custom: your own data (a JSONL or Parquet file, a directory, a hub dataset through a fake
`datasets`), your reward and your environment class, the one-line errors for each, and that today's
``--data`` values (None, a GSM8K directory, "tiny") still give exactly the splits they gave before."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import sys
import uuid
from pathlib import Path

import pytest

from helpers import fake_datasets
from sao.core.config import Config
from sao.core.errors import ConfigError, DataError
from sao.tasks import gsm8k, load_env_class, load_reward
from sao.tasks.base import Scorer, Task
from sao.tasks.custom import load_custom, source_kind
from sao.tasks.gsm8k import build_messages, decontaminate, load_gsm8k
from sao.tasks.setup import task_set

DATA = Path(__file__).resolve().parents[2] / "data" / "gsm8k"
NOUNS = ["apples", "pencils", "marbles", "tickets", "stamps", "books", "shells", "coins"]


def _question(i: int) -> str:
    """Every word 8-gram of this question holds ``i``, so distinct ``i`` never share one."""
    return f"Question {i}: how many {NOUNS[i % 8]} does team {i} need for {i} games this season?"


def _records(n: int, twins: int = 0) -> list[dict]:
    """``n`` records with custom field names; the last ``twins`` repeat the first questions word for word."""
    records = [
        {"problem": _question(i), "solution": f"x = {i}", "level": i % 3, "tags": ["count", str(i)]} for i in range(n)
    ]
    for k in range(twins):
        records.append({**records[k], "solution": f"x = {k}", "level": 9})
    return records


def _write_jsonl(path: Path, records: list[dict], blank_lines: bool = False) -> Path:
    lines = [json.dumps(r) for r in records]
    if blank_lines:
        lines = [line for pair in zip(lines, [""] * len(lines), strict=True) for line in pair]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _write_parquet(path: Path, records: list[dict], row_group_size: int = 7) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def _fingerprint(split) -> str:
    """Ids, questions, answers and counts of a split: what 'the same split' means."""
    rows = [[[t.id, t.question, t.answer] for t in split.train], [[t.id, t.question, t.answer] for t in split.test]]
    return hashlib.sha256(json.dumps([*rows, split.counts], sort_keys=True).encode()).hexdigest()


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and text.strip()
    return text


# --- today's sources are unchanged ---------------------------------------------------------------------

# Fingerprints of the splits the loaders gave before sao.tasks.custom existed (computed with the previous
# commit's sao.tasks.gsm8k on data/gsm8k, and on an identical copy of it elsewhere, with the same result).
GSM8K_DEFAULT = "289d480ba9a4425b9bfc625aa8ccac3105560855856b216b504b664079bdb20a"  # 512 / 120, seed 0
GSM8K_SEED3 = "cd1ed74bf91a0be13a7ed68dedd5de342cab16ba5fdba397db31d987acd4c006"  # 100 / 50, seed 3
TINY_DEFAULT = "09a60c6e2b5109cb66191eebcda5b4e6429128871499fce3ef344da0a8b98220"  # tiny: 480 / 120, split v2


@pytest.fixture(scope="module")
def gsm8k_split():
    return task_set(Config(data=str(DATA)))


def test_gsm8k_directory_gives_todays_split(gsm8k_split):
    assert source_kind(str(DATA)) == "directory"
    assert _fingerprint(gsm8k_split) == GSM8K_DEFAULT
    assert gsm8k_split == load_gsm8k(DATA, n_train=512, n_test=120, seed=0)
    assert gsm8k_split.source == "local:gsm8k"
    assert all(t.fields == {} and t.messages is None for t in gsm8k_split.train + gsm8k_split.test)
    other = task_set(Config(data=str(DATA), train_prompts=100, test_prompts=50, data_seed=3))
    assert _fingerprint(other) == GSM8K_SEED3


def test_default_data_is_gsm8k_from_the_hub_as_before(monkeypatch, gsm8k_split):
    calls = []
    read = {s: [json.loads(line) for line in (DATA / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "test")}

    def load_dataset(name, config):
        calls.append((name, config))
        return read

    fake_datasets(monkeypatch, load_dataset)
    for data in (None, "hub", "openai/gsm8k", "hub:openai/gsm8k"):
        split = task_set(Config(data=data))
        assert split.source == "hub:openai/gsm8k"
        assert (split.train, split.test, split.counts) == (gsm8k_split.train, gsm8k_split.test, gsm8k_split.counts)
    assert calls == [("openai/gsm8k", "main")] * 4


def test_tiny_gives_todays_split():
    split = task_set(Config.load("tiny"))
    assert _fingerprint(split) == TINY_DEFAULT
    assert all(t.fields == {} and t.messages is None for t in split.train)


def test_a_missing_directory_is_still_gsm8ks_error():
    for config in (Config(data="./no/such/dir"), Config(data="./no/such/dir", prompt_field="problem")):
        with pytest.raises(DataError, match="not a directory") as err:
            task_set(config)
        _one_line(err)


def test_source_kinds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "openai" / "gsm8k").mkdir(parents=True)
    (tmp_path / "rows.txt").write_text("")
    kinds = {
        None: "gsm8k",
        "hub": "gsm8k",
        "hub:someone/gsm8k-copy": "gsm8k",
        "tiny": "tiny",
        "openai/gsm8k": "directory",  # an existing directory wins over the hub id, as before
        str(DATA): "directory",
        "absent.jsonl": "file",  # for the loader to say it is not there
        "absent.PARQUET": "file",
        "rows.txt": "file",  # an existing file of another kind: the loader refuses it
        "someone/my-tasks": "hub",
        "squad": "hub",
        "./no/such/dir": "missing",
        "a/b/c": "missing",
    }
    assert {data: source_kind(data) for data in kinds} == kinds
    monkeypatch.chdir(DATA)
    assert source_kind("openai/gsm8k") == "gsm8k"


def test_field_options_for_gsm8k_hub_or_tiny_are_refused():
    with pytest.raises(ConfigError, match=r"--prompt-field.*not to GSM8K from the hub") as err:
        task_set(Config(prompt_field="problem"))
    _one_line(err)
    with pytest.raises(ConfigError, match=r"--messages-field.*tiny"):
        task_set(Config.load("tiny", messages_field="chat"))


def test_task_keeps_three_argument_construction_and_stays_hashable():
    a, b = Task("t/1", "q", "1"), Task(id="t/1", question="q", answer="1")
    assert a == b and a.fields == {} and a.messages is None and hash(a) == hash(b)
    assert a.fields is not b.fields  # a fresh dict each, never shared
    rich = Task("t/1", "q", "1", fields={"answer": "1", "tests": [1, 2]}, messages=[{"role": "user", "content": "q"}])
    assert hash(rich) == hash(a) and rich != a  # left out of the hash, not of equality
    with pytest.raises(dataclasses.FrozenInstanceError):
        rich.answer = "2"


# --- a JSONL file -----------------------------------------------------------------------------------------


def test_jsonl_file_with_custom_fields_splits_like_gsm8k(tmp_path):
    records = _records(40, twins=10)  # rows 40..49 repeat the questions of rows 0..9
    path = _write_jsonl(tmp_path / "items.jsonl", records, blank_lines=True)
    config = Config(data=str(path), prompt_field="problem", answer_field="solution", train_prompts=12, test_prompts=6)
    split = task_set(config.replace(data_seed=3))

    assert split.source == "file:items.jsonl"
    held_rows = sorted(random.Random(3).sample(range(50), 6))  # the held-out draw: random.Random(seed) over rows
    assert [t.id for t in split.test] == [f"items/{r}" for r in held_rows]
    pool = [Task(f"items/{i}", r["problem"], r["solution"]) for i, r in enumerate(records) if i not in held_rows]
    kept, dropped = decontaminate(pool, split.test)
    assert split.counts == {
        "train_pool": 44,
        "test_pool": 50,
        "test": 6,
        "train_contaminated": len(dropped),
        "train_kept": len(kept),
        "train": 12,
    }
    assert len(dropped) > 0  # the twins of held-out rows are dropped
    assert {t.question for t in split.train}.isdisjoint({t.question for t in split.test})
    train_rows = [int(t.id.split("/")[1]) for t in split.train]
    assert train_rows == sorted(train_rows) and not set(train_rows) & set(held_rows)

    first = split.test[0]
    row = held_rows[0]
    assert (first.question, first.answer) == (_question(row % 40), f"x = {row % 40}")  # the answer as is
    assert first.fields == records[row] and first.messages is None  # every raw field of the record

    assert task_set(config.replace(data_seed=3)) == split  # a function of its arguments
    assert task_set(config.replace(data_seed=3, train_prompts=5)).test == split.test  # n_train never moves it
    assert task_set(config.replace(data_seed=4)).test != split.test


def test_gold_marker_is_parsed_only_in_a_field_named_answer(tmp_path):
    path = _write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"question": _question(0), "answer": "She pays 3 + 4 = 7.\n#### 7", "alt": "#### 7"},
            {"question": _question(1), "answer": "  1,000 ", "alt": 1000},
            {"question": _question(2), "answer": 2.5, "alt": "x #### y"},
        ],
    )
    tasks = load_custom(path, n_train=0, n_test=3).test
    assert [t.answer for t in tasks] == ["7", "1,000", "2.5"]
    alt = load_custom(path, answer_field="alt", n_train=0, n_test=3).test
    assert [t.answer for t in alt] == ["#### 7", "1000", "x #### y"]


def test_same_directory_read_with_field_options_gives_gsm8ks_split(gsm8k_split):
    """The custom loader draws exactly as GSM8K's does: a GSM8K directory read through it (because a field
    option is given) yields the same tasks, now with their raw fields."""
    split = task_set(Config(data=str(DATA), prompt_field="question"))
    assert split.counts == gsm8k_split.counts and split.source == gsm8k_split.source
    assert [(t.id, t.question, t.answer) for t in split.train] == [
        (t.id, t.question, t.answer) for t in gsm8k_split.train
    ]
    assert [(t.id, t.question, t.answer) for t in split.test] == [
        (t.id, t.question, t.answer) for t in gsm8k_split.test
    ]
    assert "####" in split.test[0].fields["answer"]


# --- a Parquet file ---------------------------------------------------------------------------------------


def test_parquet_file_gives_the_same_split_as_the_same_jsonl(tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    records = _records(30, twins=5)
    parquet = _write_parquet(tmp_path / "items.parquet", records, row_group_size=7)
    jsonl = _write_jsonl(tmp_path / "items.jsonl", records)

    scanned = []
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        scanned.append((kwargs.get("columns"), kwargs.get("row_groups")))
        return iter_batches(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    options = {"prompt_field": "problem", "answer_field": "solution", "n_train": 10, "n_test": 8, "seed": 1}
    from_parquet = load_custom(parquet, **options)
    from_jsonl = load_custom(jsonl, **options)

    assert scanned[0] == (["problem", "solution"], None)  # the scan reads only the columns it needs
    assert all(columns is None and groups for columns, groups in scanned[1:])  # then the drawn rows' groups
    assert (from_parquet.train, from_parquet.test, from_parquet.counts) == (
        from_jsonl.train,
        from_jsonl.test,
        from_jsonl.counts,
    )
    assert from_parquet.source == "file:items.parquet"
    assert from_parquet.train[-1].fields == records[int(from_parquet.train[-1].id.split("/")[1])]


def test_parquet_messages_column(tmp_path):
    pytest.importorskip("pyarrow")
    records = [
        {"chat": [{"role": "user", "content": _question(i)}], "gold": str(i), "extra": {"k": i}} for i in range(12)
    ]
    split = load_custom(
        _write_parquet(tmp_path / "chat.parquet", records),
        messages_field="chat",
        answer_field="gold",
        n_train=4,
        n_test=4,
    )
    task = split.test[0]
    row = int(task.id.split("/")[1])
    assert task.messages == records[row]["chat"] and task.question == _question(row) and task.answer == str(row)
    assert task.fields["extra"] == {"k": row}


# --- chat messages ----------------------------------------------------------------------------------------


def test_messages_field_keeps_the_conversation_and_decontaminates_its_last_user_turn(tmp_path):
    system = "You are a careful assistant who answers every counting question with a single integer."
    records = [
        {
            "chat": [
                {"role": "system", "content": system},
                {"role": "user", "content": "Warm up: say hello."},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": _question(i)},
            ],
            "answer": str(i),
        }
        for i in range(20)
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", records)
    split = task_set(Config(data=str(path), messages_field="chat", train_prompts=10, test_prompts=5))

    task = split.train[0]
    row = int(task.id.split("/")[1])
    assert task.messages == records[row]["chat"] and task.question == _question(row) and task.answer == str(row)
    # the system turn all records share is not what decontamination compares, so nothing is dropped
    assert split.counts["train_contaminated"] == 0
    assert task.chat("End with #### N.") == records[row]["chat"]  # as given: no instruction added
    plain = Task("t/0", "What is 2+2?", "4")
    assert plain.chat("End with #### N.") == build_messages("What is 2+2?", "End with #### N.")


def test_bad_messages_name_the_line_and_field(tmp_path):
    records = [
        {"chat": [{"role": "user", "content": _question(0)}], "answer": "0"},
        {"chat": [{"role": "user"}], "answer": "1"},
    ]
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: field 'chat' message 0 must be an object") as err:
        load_custom(_write_jsonl(tmp_path / "bad.jsonl", records), messages_field="chat", n_train=0, n_test=1)
    _one_line(err)


# --- a hub dataset (a fake `datasets`: nothing is downloaded) --------------------------------------------


class FakeSplit:
    """The parts of a datasets.Dataset the loader uses; records which columns a scan selected."""

    def __init__(self, records: list[dict], selected: list | None = None) -> None:
        self.records, self.selected = records, selected if selected is not None else []
        self.column_names = list(records[0])

    def select_columns(self, columns: list[str]) -> list[dict]:
        self.selected.append(columns)
        return [{c: r[c] for c in columns} for r in self.records]

    def __iter__(self):
        return iter(self.records)

    def __getitem__(self, row: int) -> dict:
        return self.records[row]


def test_hub_dataset_uses_its_train_and_test_splits(monkeypatch):
    calls = []
    train = FakeSplit([{"prompt": _question(i), "target": str(i), "source": "train"} for i in range(30)])
    test = FakeSplit([{"prompt": _question(i), "target": str(i), "source": "test"} for i in range(25, 40)])

    def load_dataset(name):
        calls.append(name)
        return {"train": train, "test": test}

    fake_datasets(monkeypatch, load_dataset)
    assert source_kind("someone/my-tasks") == "hub"
    config = Config(data="someone/my-tasks", prompt_field="prompt", answer_field="target", train_prompts=8)
    split = task_set(config.replace(test_prompts=6))

    assert calls == ["someone/my-tasks"] and split.source == "hub:someone/my-tasks"
    assert train.selected == [["prompt", "target"]] and test.selected == [["prompt", "target"]]
    assert all(t.id.startswith("someone/my-tasks/test/") for t in split.test)
    assert split.counts["train_pool"] == 30 and split.counts["test_pool"] == 15
    held = {t.question for t in split.test}
    assert split.counts["train_contaminated"] == sum(_question(i) in held for i in range(30))
    assert all(t.fields["source"] == "test" for t in split.test)  # the whole row, read back after the draw
    assert all(t.fields["source"] == "train" for t in split.train)


def test_hub_dataset_without_a_test_split_or_unreachable_is_one_line(monkeypatch):
    fake_datasets(monkeypatch, lambda name: {"train": FakeSplit([{"question": "q", "answer": "1"}])})
    with pytest.raises(DataError, match=r"hub:someone/tasks has no 'test' split \(splits: train\)") as err:
        task_set(Config(data="someone/tasks"))
    _one_line(err)

    def unreachable(name):
        raise ConnectionError("Couldn't reach 'someone/tasks' on the Hub\nmore detail")

    fake_datasets(monkeypatch, unreachable)
    with pytest.raises(DataError, match=r"ConnectionError.*no local file or directory 'someone/tasks'") as err:
        task_set(Config(data="someone/tasks"))
    _one_line(err)


def test_hub_missing_column_names_it(monkeypatch):
    rows = FakeSplit([{"question": _question(i), "answer": "1"} for i in range(4)])
    fake_datasets(monkeypatch, lambda name: {"train": rows, "test": rows})
    with pytest.raises(DataError, match=r"hub:someone/tasks train: no column 'problem'.*--prompt-field") as err:
        task_set(Config(data="someone/tasks", prompt_field="problem", train_prompts=1, test_prompts=1))
    _one_line(err)


# --- one-line data errors ---------------------------------------------------------------------------------


def test_missing_field_names_file_line_and_field(tmp_path):
    records = _records(5)
    del records[2]["problem"]
    path = _write_jsonl(tmp_path / "items.jsonl", records)
    with pytest.raises(DataError) as err:
        task_set(Config(data=str(path), prompt_field="problem", answer_field="solution"))
    text = _one_line(err)
    assert f"{path} line 3" in text and "'problem'" in text and "--prompt-field" in text

    with pytest.raises(DataError, match=r"line 1: no 'answer' field .*--answer-field") as err:
        load_custom(path, prompt_field="problem", n_train=1, n_test=1)  # the default answer field
    _one_line(err)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"question": "q1 is here", "answer": "1"}\nnot json\n', "line 2: not valid JSON"),
        ('{"question": "q1 is here", "answer": null}\n', "line 1: field 'answer' is empty (null)"),
        ('{"question": "", "answer": "1"}\n', "line 1: field 'question' must be a non-empty string"),
        ('{"question": "q", "answer": ["a", "b"]}\n', "line 1: field 'answer' (the gold answer) must be a string or"),
        ('["question", "answer"]\n', "line 1: expected an object with fields, got list"),
        ("\n\n", "file is empty"),
    ],
)
def test_bad_jsonl_is_one_line(tmp_path, text, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataError) as err:
        load_custom(path, n_train=0, n_test=1)
    assert needle in _one_line(err) and str(path) in str(err.value)


def test_missing_parquet_column_and_file_errors(tmp_path):
    path = _write_parquet(tmp_path / "items.parquet", _records(5))
    with pytest.raises(DataError, match=r"items\.parquet: no column 'answer' \(columns: problem, .*--answer-field"):
        load_custom(path, prompt_field="problem", n_train=1, n_test=1)
    with pytest.raises(DataError, match="file not found") as err:
        load_custom(tmp_path / "absent.jsonl", n_train=1, n_test=1)
    _one_line(err)
    other = tmp_path / "items.csv"
    other.write_text("question,answer\n")
    with pytest.raises(DataError, match=r"expected a \.jsonl or \.parquet file"):
        load_custom(other, n_train=1, n_test=1)


def test_too_few_records_names_the_numbers(tmp_path):
    path = _write_jsonl(tmp_path / "items.jsonl", _records(10))
    with pytest.raises(DataError, match=r"asked for 11 held-out tasks but .* has only 10 records"):
        load_custom(path, prompt_field="problem", answer_field="solution", n_train=0, n_test=11)
    with pytest.raises(DataError, match=r"asked for 8 training prompts but only 7 remain"):
        load_custom(path, prompt_field="problem", answer_field="solution", n_train=8, n_test=3)


def test_prompt_and_messages_fields_together_are_refused(tmp_path):
    path = _write_jsonl(tmp_path / "items.jsonl", _records(5))
    with pytest.raises(ConfigError, match="both name the prompt"):
        task_set(Config(data=str(path), prompt_field="problem", messages_field="chat"))


# --- your reward and your environment ------------------------------------------------------------------


REWARDS = """
    def contains_gold(completion, row):
        return float(row["answer"] in completion)

    def by_field(completion, row):
        return len(row["tests"]) * 0.5

    def says_yes(completion, task):
        return "yes"

    def nan(completion, task):
        return float("nan")

    def one_argument(completion):
        return 1.0

    LIMIT = 3
"""


def test_custom_reward_is_loaded_and_called_with_the_row_as_plain_data(user_module):
    module = user_module(REWARDS)
    reward = Scorer(load_reward(f"{module}:contains_gold"))
    row = Task("t/1", "q", "42").row()
    assert reward.score(["so the total is 42 apples", "so the total is 41 apples"], [row, row]) == [1.0, 0.0]
    rich = Task("t/2", "q", "x", fields={"tests": ["a", "b", "c"]}).row()
    assert isinstance(rich, dict) and rich["tests"] == ["a", "b", "c"] and rich.answer == "x"
    assert Scorer(load_reward(f"{module}:by_field")).score([""], [rich]) == [1.5]


def test_custom_reward_must_return_a_finite_number(user_module):
    module = user_module(REWARDS)
    row = Task("t/1", "q", "1").row()
    with pytest.raises(ConfigError, match=r"returned 'yes' for t/1; it must return a number") as err:
        Scorer(load_reward(f"{module}:says_yes")).score(["c"], [row])
    _one_line(err)
    with pytest.raises(ConfigError, match="must return a finite number"):
        Scorer(load_reward(f"{module}:nan")).score(["c"], [row])


def test_default_reward_is_the_gsm8k_grader():
    assert gsm8k.reward("... so 9 + 9 = 18.\n#### 18", Task("t", "q", "18").row()) == 1.0
    assert gsm8k.reward("#### 17", {"answer": "18"}) == 0.0


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("no_colon_here", "expected 'module:function'"),
        ("module:", "expected 'module:function'"),
        ("a:b:c", "expected 'module:function'"),
        ("rewards.py:score", "name the module as you would import it"),
        ("sao_no_such_module_7f3a:score", "no module named 'sao_no_such_module_7f3a'"),
        ("{module}:missing_function", "has no 'missing_function'"),
        ("{module}:LIMIT", "'LIMIT' is a int, not a function (not callable)"),
        ("{module}:one_argument", "cannot be called as (completion, row)"),
    ],
)
def test_bad_reward_spec_is_one_line(user_module, spec, needle):
    module = user_module(REWARDS)
    with pytest.raises(ConfigError) as err:
        load_reward(spec.format(module=module))
    text = _one_line(err)
    assert needle in text and text.startswith("--reward ")


def test_a_module_failing_inside_says_so(user_module):
    module = user_module(
        "import sao_dependency_that_is_not_installed\n\ndef score(completion, task):\n    return 1.0\n"
    )
    with pytest.raises(ConfigError, match=r"importing '.*' failed \(ModuleNotFoundError: .*sao_dependency") as err:
        load_reward(f"{module}:score")
    _one_line(err)


ENVS = """
    class EchoEnv:
        def __init__(self, task_id, fields):
            self.task_id, self.fields, self.closed = task_id, fields, False

        def init(self, prompt):
            return prompt, {"task": self.task_id}

        def step(self, action):
            return {"observations": [], "reward": float(self.fields["answer"] in action), "done": True}

        def close(self):
            self.closed = True

    class NoStep:
        def __init__(self, task_id, fields):
            pass

        def init(self, prompt):
            return prompt, {}

        def close(self):
            pass

    class WrongArguments(EchoEnv):
        def __init__(self, task_id):
            pass

    class AsyncInitPlainStep(EchoEnv):
        async def init(self, prompt):
            return prompt, {}

    class AsyncEnv(EchoEnv):
        async def step(self, action):
            return {"observations": [], "reward": 0.0, "done": True}
"""


def test_custom_env_class_builds_one_env_per_task(user_module):
    module = user_module(ENVS)
    factory = load_env_class(f"{module}:EchoEnv")
    env = factory("t/7", {"answer": "7"})
    assert type(env).__name__ == "EchoEnv" and env.task_id == "t/7"
    messages, info = env.init([{"role": "user", "content": "What is 3+4?"}])
    assert messages == [{"role": "user", "content": "What is 3+4?"}] and info == {"task": "t/7"}
    assert env.step("It is 7.") == {"observations": [], "reward": 1.0, "done": True}
    env.close()
    assert env.closed


@pytest.mark.parametrize(
    ("attribute", "needle"),
    [
        ("NoStep", "class NoStep has no step method; an environment needs init, step and close"),
        ("WrongArguments", "cannot be called as (task_id, fields)"),
        ("Missing", "has no 'Missing'"),
        ("AsyncInitPlainStep", "init is async def but step is not; make step async def too"),
    ],
)
def test_bad_env_class_is_one_line(user_module, attribute, needle):
    module = user_module(ENVS)
    with pytest.raises(ConfigError) as err:
        load_env_class(f"{module}:{attribute}")
    text = _one_line(err)
    assert needle in text and text.startswith("--env ")


def test_an_async_env_class_is_accepted_as_it_is(user_module):
    assert load_env_class(f"{user_module(ENVS)}:AsyncEnv").__name__ == "AsyncEnv"


def test_current_directory_is_appended_only_when_needed(tmp_path, monkeypatch):
    name = f"sao_user_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text("def score(completion, task):\n    return 0.25\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    cwd = os.getcwd()
    # as under the `sao` console script: neither "" nor the current directory on sys.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and os.path.abspath(p) != cwd])
    try:
        with pytest.raises(ConfigError, match="no module named 'sao_absent_9c1d'"):
            load_reward("sao_absent_9c1d:score")
        assert cwd not in sys.path  # a failed try leaves sys.path as it was
        assert load_reward(f"{name}:score")("c", {"answer": "a"}) == 0.25
        assert sys.path[-1] == cwd and sys.path.count(cwd) == 1  # appended, so it shadows nothing installed
        assert load_reward(f"{name}:score")("c", {"answer": "a"}) == 0.25
        assert sys.path.count(cwd) == 1
    finally:
        sys.modules.pop(name, None)


# --- nested field paths: verl- and SkyRL-style rows read as they are ---------------------------------------


def _verl_rows(n: int) -> list[dict]:
    """Rows laid out as verl's preprocessed parquet: chat messages, the answer under reward_model, extra_info."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": _question(i)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"split": "train", "index": i, "question": _question(i)},
        }
        for i in range(n)
    ]


def _skyrl_rows(n: int) -> list[dict]:
    """Rows laid out as SkyRL's datasets: chat messages, env_class, the answer under reward_spec."""
    return [
        {
            "data_source": "gsm8k",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": _question(i)}],
            "env_class": "gsm8k",
            "reward_spec": {"method": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_verl_rows_read_with_dotted_field_paths(tmp_path, suffix):
    rows = _verl_rows(12)
    write = _write_jsonl if suffix == ".jsonl" else _write_parquet
    path = write(tmp_path / f"verl{suffix}", rows)
    split = load_custom(path, messages_field="prompt", answer_field="reward_model.ground_truth", n_train=4, n_test=3)
    for task in [*split.train, *split.test]:
        i = int(task.answer)
        assert task.question == _question(i) and task.messages == rows[i]["prompt"]
        assert task.fields["reward_model"]["ground_truth"] == str(i)  # the whole row reaches the reward
    by_text = load_custom(
        path, prompt_field="extra_info.question", answer_field="reward_model.ground_truth", n_train=4, n_test=3
    )
    assert [t.question for t in by_text.test] == [t.question for t in split.test] and by_text.test[0].messages is None


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_skyrl_rows_read_with_dotted_field_paths(tmp_path, suffix):
    rows = _skyrl_rows(10)
    write = _write_jsonl if suffix == ".jsonl" else _write_parquet
    path = write(tmp_path / f"skyrl{suffix}", rows)
    split = task_set(
        Config(
            data=str(path),
            messages_field="prompt",
            answer_field="reward_spec.ground_truth",
            train_prompts=3,
            test_prompts=2,
        )
    )
    for task in [*split.train, *split.test]:
        assert task.messages[0] == {"role": "system", "content": "Be brief."} and task.question == _question(
            int(task.answer)
        )


def test_a_key_spelled_with_dots_wins_over_the_path(tmp_path):
    rows = [{"question": _question(i), "a.b": f"flat {i}", "a": {"b": f"nested {i}"}} for i in range(4)]
    path = _write_jsonl(tmp_path / "dots.jsonl", rows)
    split = load_custom(path, answer_field="a.b", n_train=1, n_test=1)
    assert split.test[0].answer.startswith("flat ")


@pytest.mark.parametrize(
    ("answer_field", "needle"),
    [
        ("reward_model.answer", "no 'reward_model.answer' field ('reward_model' has: style, ground_truth)"),
        ("reward.ground_truth", "no 'reward.ground_truth' field (the record has: data_source, prompt,"),
        ("ability.level", "no 'ability.level' field ('ability' is a str, not an object)"),
    ],
)
def test_a_missing_field_path_is_one_line_naming_the_path_and_row(tmp_path, faults, answer_field, needle):
    path = _write_jsonl(tmp_path / "verl.jsonl", _verl_rows(4))
    with pytest.raises(DataError) as err:
        load_custom(path, messages_field="prompt", answer_field=answer_field, n_train=1, n_test=1)
    text = _one_line(err)
    assert f"{path} line 1: {needle}" in text and text.endswith("name it with --answer-field")
    faults.record("conventions", f"--answer-field {answer_field} missing from a verl row")


def test_a_missing_parquet_column_of_a_path_names_both(tmp_path, faults):
    path = _write_parquet(tmp_path / "verl.parquet", _verl_rows(4))
    with pytest.raises(DataError) as err:
        load_custom(path, messages_field="prompt", answer_field="reward_spec.ground_truth", n_train=1, n_test=1)
    assert "no column 'reward_spec' for 'reward_spec.ground_truth' (columns: data_source," in _one_line(err)
    faults.record("conventions", "--answer-field path whose column a parquet file lacks")


def test_sao_train_refuses_a_missing_field_path_in_one_line(tmp_path, capsys, faults):
    from helpers import refused_in_one_line

    path = _write_jsonl(tmp_path / "verl.jsonl", _verl_rows(4))
    out = tmp_path / "run"
    argv = [
        "train",
        "--preset",
        "tiny",
        "--data",
        str(path),
        "--messages-field",
        "prompt",
        "--answer-field",
        "reward_model.answer",
        "--out",
        str(out),
    ]
    refused_in_one_line(capsys, argv, out, f"{path} line 1: no 'reward_model.answer' field", "--answer-field")
    faults.record("conventions", "sao train --answer-field path missing from a verl row")


# --- your prompts are sent as given ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["text", "messages"])
def test_data_file_prompts_reach_the_model_as_the_chat_template_of_the_users_messages(tmp_path, layout):
    from sao.tasks.setup import parts
    from sao.tiny.arithmetic import build_tokenizer

    rows = _skyrl_rows(8) if layout == "messages" else [{"q": _question(i), "a": str(i)} for i in range(8)]
    path = _write_jsonl(tmp_path / "mine.jsonl", rows)
    fields = (
        {"messages_field": "prompt", "answer_field": "reward_spec.ground_truth"}
        if layout == "messages"
        else {"prompt_field": "q", "answer_field": "a"}
    )
    config = Config(data=str(path), train_prompts=4, test_prompts=2, env="gsm8k", **fields)
    tasks = task_set(config)
    tokenizer = build_tokenizer()
    made = parts(config, tokenizer, tasks)
    assert tasks.instruction == ""
    for task in tasks.train:
        i = int(task.answer)
        given = rows[i]["prompt"] if layout == "messages" else [{"role": "user", "content": rows[i]["q"]}]
        expected = tokenizer.apply_chat_template(given, tokenize=False, add_generation_prompt=True)
        assert made.prompts[task.id] == expected  # a single reply continues exactly the user's conversation
        assert made.episodes.messages[task.id] == given  # and an environment starts from it


def test_gsm8k_keeps_its_instruction_on_purpose(gsm8k_split):
    assert gsm8k_split.instruction == gsm8k.DEFAULT_INSTRUCTION
    assert gsm8k_split.train[0].chat(gsm8k_split.instruction)[0]["content"].endswith(gsm8k.DEFAULT_INSTRUCTION)
