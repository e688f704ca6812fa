"""sao.tasks.gsm8k: the GSM8K split (counts, determinism, decontamination), file validation, the hub path and
prompt formatting. No network: the hub is a fake module and the tokenizer is built locally."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import fake_datasets
from sao.core.errors import DataError
from sao.tasks.base import Task
from sao.tasks.gsm8k import (
    DEFAULT_INSTRUCTION,
    build_messages,
    decontaminate,
    format_prompt,
    load_gsm8k,
    read_jsonl_tasks,
    word_ngrams,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "gsm8k"


# --- the real local data --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def split0():
    return load_gsm8k(DATA, seed=0)


def test_local_split_counts(split0):
    c = split0.counts
    assert split0.source == "local:gsm8k"
    assert (c["train_pool"], c["test_pool"], c["test"], c["train"]) == (7473, 1319, 120, 512)
    assert len(split0.train) == 512 and len(split0.test) == 120
    assert c["train_contaminated"] > 0
    assert c["train_contaminated"] == c["train_pool"] - c["train_kept"]
    # counts agree with an independent recomputation from the returned held-out set
    kept, dropped = decontaminate(read_jsonl_tasks(DATA / "train.jsonl", "train"), split0.test)
    assert (len(kept), len(dropped)) == (c["train_kept"], c["train_contaminated"])


def test_local_split_is_clean_and_well_formed(split0):
    held = set().union(*(word_ngrams(t.question) for t in split0.test))
    assert all(not (word_ngrams(t.question) & held) for t in split0.train)
    assert len({t.id for t in split0.train}) == 512 and len({t.id for t in split0.test}) == 120
    assert all(t.id.startswith("gsm8k/train/") for t in split0.train)
    assert all(t.id.startswith("gsm8k/test/") for t in split0.test)
    rows = [int(t.id.rsplit("/", 1)[1]) for t in split0.test]
    assert rows == sorted(rows)
    assert all(t.answer and "####" not in t.answer for t in split0.train + split0.test)


def test_first_test_record_is_parsed():
    first = read_jsonl_tasks(DATA / "test.jsonl", "test")[0]
    assert first.id == "gsm8k/test/0"
    assert first.question.startswith("Janet\u2019s ducks lay 16 eggs")
    assert first.answer == "18"


def test_same_seed_same_split_other_seed_differs(split0):
    again = load_gsm8k(str(DATA), seed=0)
    assert [t.id for t in again.train] == [t.id for t in split0.train]
    assert [t.id for t in again.test] == [t.id for t in split0.test]
    assert again.counts == split0.counts
    other = load_gsm8k(DATA, seed=1)
    assert {t.id for t in other.test} != {t.id for t in split0.test}
    # two independent draws of 512 from ~7470 share about 35 tasks; a seed-blind train draw would share ~all
    assert len({t.id for t in other.train} & {t.id for t in split0.train}) < 100


def test_held_out_does_not_depend_on_n_train(split0):
    smaller = load_gsm8k(DATA, n_train=16, seed=0)
    assert [t.id for t in smaller.test] == [t.id for t in split0.test]


def test_too_few_prompts_names_the_numbers(split0):
    kept = split0.counts["train_kept"]
    with pytest.raises(DataError, match=rf"asked for {kept + 1} training prompts but only {kept} remain"):
        load_gsm8k(DATA, n_train=kept + 1)
    with pytest.raises(DataError, match=r"asked for 1320 held-out tasks .* only 1319"):
        load_gsm8k(DATA, n_test=1320)


# --- decontamination ------------------------------------------------------------------------------------

HELD = "Tom has 3 red apples and 5 green pears in his old wooden basket at home today."


def _t(i: int, q: str) -> Task:
    return Task(id=f"t/{i}", question=q, answer="1")


def test_word_ngrams_normalises_case_and_punctuation():
    assert word_ngrams("Janet\u2019s $2-eggs, DAILY!", n=2) == {
        ("janet", "s"),
        ("s", "2"),
        ("2", "eggs"),
        ("eggs", "daily"),
    }
    assert word_ngrams("one two three", n=8) == set()
    assert len(word_ngrams(HELD)) == len(HELD.split()) - 7


def test_decontaminate_drops_duplicates_and_shared_8grams():
    held_out = [_t(0, HELD)]
    exact = _t(1, HELD)
    # shares exactly one 8-gram ("3 red apples and 5 green pears in") with other casing and punctuation
    near = _t(2, "Yesterday, Mia saw: 3 RED apples -- and 5 GREEN pears, in a shop window near the station.")
    # shares the 7-gram "3 red apples and 5 green pears" but no 8-gram
    seven = _t(3, "Maria counted 3 red apples and 5 green pears on a busy market stall.")
    unrelated = _t(4, "A train travels 60 miles per hour for 3 hours. How far does it travel in total?")
    kept, dropped = decontaminate([exact, near, seven, unrelated], held_out)
    assert dropped == [exact, near]
    assert kept == [seven, unrelated]
    assert len(word_ngrams(near.question) & word_ngrams(HELD)) == 1


def test_decontaminate_against_nothing_keeps_everything():
    train = [_t(i, HELD) for i in range(3)]
    assert decontaminate(train, []) == (train, [])


# --- bad files -------------------------------------------------------------------------------------------

GOOD = json.dumps({"question": "What is one plus one, written as a number please?", "answer": "1+1=2\n#### 2"})


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        (GOOD + "\nthis is not json\n", 2, "not valid JSON"),
        (GOOD + "\n" + GOOD[:-1] + "\n", 2, "not valid JSON"),  # truncated last line, newline-terminated
        (GOOD + "\n" + GOOD[:-5], 2, "not valid JSON"),  # truncated last line, no newline
        (GOOD + "\n\n" + json.dumps({"answer": "#### 3"}) + "\n", 3, "no 'question'"),
        (json.dumps({"question": "How many?"}) + "\n", 1, "no 'answer'"),
        (GOOD + "\n" + json.dumps({"question": "How many?", "answer": "It is 4."}) + "\n", 2, "gold"),
        (json.dumps({"question": "How many?", "answer": "#### "}) + "\n", 1, "gold"),
        (json.dumps({"question": "", "answer": "#### 4"}) + "\n", 1, "non-empty string"),
        ("[1, 2]\n", 1, "JSON object"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, text, line, what):
    path = _write(tmp_path / "train.jsonl", text)
    with pytest.raises(DataError) as err:
        read_jsonl_tasks(path, "train")
    message = str(err.value)
    assert f"train.jsonl line {line}:" in message and what in message
    assert "\n" not in message


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_file(tmp_path, text):
    with pytest.raises(DataError, match=r"test\.jsonl: file is empty"):
        read_jsonl_tasks(_write(tmp_path / "test.jsonl", text), "test")


def test_missing_file_and_directory(tmp_path):
    _write(tmp_path / "train.jsonl", GOOD + "\n")
    with pytest.raises(DataError, match=r"test\.jsonl: file not found"):
        load_gsm8k(tmp_path, n_train=1, n_test=1)
    with pytest.raises(DataError, match="not a directory"):
        load_gsm8k(tmp_path / "nowhere", n_train=1, n_test=1)


def test_blank_lines_skipped_and_gold_is_after_last_marker(tmp_path):
    record = {"question": "Q one two three four five six seven eight?", "answer": "a #### b\n#### 1,000 "}
    path = _write(tmp_path / "test.jsonl", "\n" + json.dumps(record) + "\n\n" + GOOD + "\n")
    tasks = read_jsonl_tasks(path, "test")
    assert [t.id for t in tasks] == ["gsm8k/test/0", "gsm8k/test/1"]
    assert [t.answer for t in tasks] == ["1,000", "2"]


# --- the hub path (a fake `datasets` module; nothing is downloaded) ---------------------------------------


def _records(prefix: str, k: int) -> list[dict[str, str]]:
    return [
        {"question": f"{prefix} question number {i} about {i} unique things", "answer": f"#### {i}"} for i in range(k)
    ]


def test_hub_path_goes_through_datasets(monkeypatch):
    calls = []

    def load_dataset(name, config):
        calls.append((name, config))
        return {"train": _records("train", 6), "test": _records("test", 4)}

    fake_datasets(monkeypatch, load_dataset)
    split = load_gsm8k(None, n_train=3, n_test=2, seed=5)
    assert calls == [("openai/gsm8k", "main")]
    assert split.source == "hub:openai/gsm8k"
    assert split.counts["train_pool"] == 6 and split.counts["test_pool"] == 4
    assert len(split.train) == 3 and len(split.test) == 2
    assert all(t.id.startswith("gsm8k/test/") for t in split.test)
    assert load_gsm8k("hub", n_train=3, n_test=2, seed=5) == split
    load_gsm8k("someone/gsm8k-copy", n_train=1, n_test=1)
    assert calls[-1] == ("someone/gsm8k-copy", "main")


def test_hub_bad_record_names_the_row(monkeypatch):
    fake_datasets(monkeypatch, lambda name, config: {"train": [{"question": "q", "answer": "no gold"}], "test": []})
    with pytest.raises(DataError, match=r"hub:openai/gsm8k train row 0: .*gold"):
        load_gsm8k(None)


def test_hub_failure_says_use_data_flag(monkeypatch):
    def load_dataset(name, config):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore")

    fake_datasets(monkeypatch, load_dataset)
    with pytest.raises(DataError, match=r"--data DIR") as err:
        load_gsm8k(None)
    assert "ConnectionError" in str(err.value) and "\n" not in str(err.value)


def test_datasets_not_installed_says_use_data_flag(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(DataError, match=r"'datasets' package.*--data DIR"):
        load_gsm8k("hub")


# --- prompts ----------------------------------------------------------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.chat_template = chat_template
    return tok


def test_build_messages_is_one_user_turn():
    assert build_messages("  How many?  ", "Show work.") == [{"role": "user", "content": "How many?\n\nShow work."}]
    assert build_messages("How many?", "") == [{"role": "user", "content": "How many?"}]
    assert "####" in DEFAULT_INSTRUCTION


def test_format_prompt_uses_chat_template():
    question = "Janet has 3 ducks. How many legs?"
    prompt = format_prompt(_tokenizer(CHATML), question)
    assert prompt == f"<|im_start|>user\n{question}\n\n{DEFAULT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert "system" not in prompt


def test_format_prompt_without_chat_template():
    with pytest.raises(DataError, match="no chat template") as err:
        format_prompt(_tokenizer(None), "How many?")
    assert "\n" not in str(err.value)
