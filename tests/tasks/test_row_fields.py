"""Rows passed from Python are read with the field settings ``--data`` reads files with: ``messages_field`` names
the chat messages (``prompt_field``, ``answer_field`` likewise), and a chat row without a ``prompt`` is told that
chat messages go there too, or which field to name."""

from __future__ import annotations

import pytest

from sao.core.config import Config
from sao.core.errors import DataError
from sao.tasks import setup

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


def test_messages_field_is_honoured_for_rows(faults):
    rows = [{"chat": CHAT, "gold": {"value": "5"}, "id": i} for i in range(4)]
    config = Config.load("tiny", messages_field="chat", answer_field="gold.value", train_prompts=4)
    tasks = setup.task_set(config, rows)
    assert [t.messages for t in tasks.train] == [CHAT] * 4
    assert {t.question for t in tasks.train} == {"What is 2+3?"} and {t.answer for t in tasks.train} == {"5"}
    assert tasks.train[0].fields["gold"] == {"value": "5"}, "every field still reaches the reward"
    faults.record("first hour", "rows with chat messages under messages_field")


def test_prompt_field_is_honoured_for_rows():
    config = Config.load("tiny", prompt_field="text", train_prompts=2)
    tasks = setup.task_set(config, [{"text": "What is 1+1?", "answer": 2}, {"text": "What is 2+2?", "answer": 4}])
    assert [t.question for t in tasks.train] == ["What is 1+1?", "What is 2+2?"]
    assert [t.answer for t in tasks.train] == ["2", "4"]


@pytest.mark.parametrize("key", ["messages", "conversation"])
def test_a_chat_row_without_a_prompt_is_told_where_chat_messages_go(key, faults):
    config = Config.load("tiny", train_prompts=1)
    with pytest.raises(DataError) as caught:
        setup.task_set(config, [{key: CHAT, "answer": "5"}])
    message = str(caught.value)
    assert "\n" not in message and message.startswith("dataset row train 0: no 'prompt' field"), message
    assert "as text or as chat messages" in message and f"messages_field={key!r}" in message, message
    faults.record("first hour", f"a chat row with its messages under {key!r} and no prompt")
