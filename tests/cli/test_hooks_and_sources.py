"""Hooks and sources passed to ``sao.train``: a hook class or a function where an instance belongs, an object that is
not a source, ``next_batch`` returning None, ``on_pass`` returning what a log line cannot hold or a field the record
holds itself, are each a TypeError or ValueError naming the hook or the source, with ``out_dir`` as it was found so
the corrected call runs; an ``on_close`` that raises after a failure never hides the failure; and hook state is
keyed so that no two hooks, nor a hook of yours named like a built-in, take each other's on --resume."""

from __future__ import annotations

from typing import Any

import pytest

import sao
from sao.training.trainer import Hook

ROWS = [{"prompt": f"What is {i}+{i}? End with #### N.", "answer": str(2 * i)} for i in range(16)]
SETTINGS = {"preset": "tiny", "batch_size": 4, "steps": 1, "critic_warmup": 1, "max_new_tokens": 8}


def _train(out, **parts: Any):
    return sao.train(SETTINGS, out, dataset=ROWS, progress=False, **parts)


def _refused(out, error: type[Exception], *needles: str, **parts: Any) -> str:
    with pytest.raises(error) as caught:
        _train(out, **parts)
    message = str(caught.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    assert not out.exists(), "out_dir is left as it was found (absent)"
    return message


class Counter(Hook):
    """A stateful hook: counts the steps it saw; ``loaded`` is what --resume handed it back."""

    def __init__(self, name: str = "hook", start: int = 0):
        self.name, self.count, self.loaded = name, start, None

    def on_step_end(self, trainer, record) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "who": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def test_a_hook_class_where_an_instance_belongs_is_refused_and_the_corrected_call_runs(
    tmp_path, faults, tiny_model_dir
):
    out = tmp_path / "run"
    _refused(
        out, TypeError, "hooks[0] is the class Counter, not a hook", "pass an instance, Counter()", hooks=[Counter]
    )
    faults.record("hooks and sources", "a hook class where an instance belongs")
    done = _train(out, hooks=[Counter()])  # the corrected call is not refused: out was left as found
    assert len(done.records) == 2


def test_a_function_or_a_non_list_is_not_a_hook(tmp_path, faults):
    out = tmp_path / "run"

    def on_pass(trainer, batch, forward):
        return {}

    _refused(out, TypeError, "hooks[0] is the function", "on_pass", "not a hook", hooks=[on_pass])
    _refused(out, TypeError, "hooks must be a list of hooks", hooks=Counter())
    faults.record("hooks and sources", "a function where a hook belongs")


class NotASource:
    max_staleness, tasks = 0, {}


def test_an_object_that_is_not_a_source_is_refused_before_anything(tmp_path, faults):
    out = tmp_path / "run"
    _refused(out, TypeError, "source is a NotASource, not a source", "next_batch", source=NotASource())
    _refused(out, TypeError, "source is the class NotASource", "pass an instance", source=NotASource)
    faults.record("hooks and sources", "an object that is not a source")


class NoBatch:
    """Every method a source has; next_batch returns None."""

    max_staleness = 0

    def __init__(self):
        self.tasks = {}

    def next_batch(self, step, phase, policy_version):
        return None

    def after_update(self, policy_version):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def close(self):
        pass


def test_next_batch_returning_none_names_the_source(tmp_path, faults, tiny_model_dir):
    out = tmp_path / "run"
    _refused(out, TypeError, "source NoBatch: next_batch returned None on step 0", "Batch", source=NoBatch())
    faults.record("hooks and sources", "next_batch returning None")


class Extras(Hook):
    def __init__(self, extras: Any, name: str = "hook"):
        self.extras, self.name = extras, name

    def on_pass(self, trainer, batch, forward):
        return self.extras


@pytest.mark.parametrize(
    ("extras", "needles"),
    [
        (None, ("hook Extras: on_pass returned None", "{} for none")),
        ([1, 2], ("on_pass returned [1, 2]", "dict")),
        ({"mine": object()}, ("on_pass returned 'mine', which is <object", "cannot hold")),
        ({3: 1.0}, ("on_pass returned the key 3", "string keys")),
    ],
    ids=["None", "a list", "an object", "a number as key"],
)
def test_on_pass_returning_what_a_log_line_cannot_hold_names_the_hook(
    tmp_path, extras, needles, faults, tiny_model_dir
):
    out = tmp_path / "run"
    _refused(out, TypeError, *needles, hooks=[Extras(extras)])
    faults.record("hooks and sources", f"on_pass returning {type(extras).__name__}")


@pytest.mark.parametrize("field", ["step", "reward_mean", "loss"])
def test_hook_extras_never_overwrite_the_records_own_fields(tmp_path, field, faults, tiny_model_dir):
    out = tmp_path / "run"
    _refused(
        out,
        ValueError,
        f"on_pass returned '{field}', a field the step's record holds itself",
        hooks=[Extras({field: 123.0}, name="mine")],
    )
    faults.record("hooks and sources", f"hook extras named like the record's {field}")


def test_two_hooks_never_return_the_same_field(tmp_path, faults, tiny_model_dir):
    out = tmp_path / "run"
    _refused(
        out,
        ValueError,
        "hooks Mismatch ('mismatch') and Extras ('mine') both return 'mismatch_fresh'",
        hooks=[Extras({"mismatch_fresh": 0.0}, name="mine")],
    )
    faults.record("hooks and sources", "hook extras named like a built-in hook's (mismatch_fresh)")


class FailsThenFailsToClose(Hook):
    def on_pass(self, trainer, batch, forward):
        raise LookupError("the first failure")

    def on_close(self, trainer):
        raise RuntimeError("closing failed too")


def test_an_on_close_error_never_hides_the_error_that_caused_it(tmp_path, faults, tiny_model_dir):
    out = tmp_path / "run"
    with pytest.raises(LookupError, match="the first failure") as caught:
        _train(out, hooks=[FailsThenFailsToClose()])
    notes = getattr(caught.value, "__notes__", [])
    assert any("on_close raised RuntimeError: closing failed too" in note for note in notes), notes
    assert not out.exists(), "the failed run's folder undone all the same"
    faults.record("hooks and sources", "an on_close that raises after a failure")


def test_hook_state_is_keyed_so_no_two_hooks_take_each_others(tmp_path, faults, tiny_model_dir):
    """Two stateful hooks of yours with the default name, and one named like the built-in reachability hook: each gets
    its own state back on --resume, and the built-in keeps its own."""
    from sao.training import build, checkpoint
    from sao.training.hooks import Reachability

    out = tmp_path / "run"
    _train(out, hooks=[Counter(start=10), Counter(start=20), Counter(name="reachability", start=30)])
    saved = checkpoint.load(out)["hooks"]
    assert saved["reachability"] == Reachability(0.0, (0.7, 6.0), 1).state_dict(), "the built-in's own state"
    again = [Counter(), Counter(), Counter(name="reachability")]
    trainer = build.trainer(sao.Config.load(**SETTINGS), out, dataset=ROWS, hooks=again, resume=True, progress=False)
    trainer.run_dir.release()
    assert [h.loaded for h in again] == [
        {"count": 12, "who": "hook"},
        {"count": 22, "who": "hook"},
        {"count": 32, "who": "reachability"},
    ]
    faults.record("hooks and sources", "two stateful hooks named alike, one named like a built-in, on --resume")
