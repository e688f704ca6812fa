"""The environment seam: what an agent's trajectory talks to between its actions.

One interface, the ecosystem's (SkyRL-Gym's text environment), so that its environments plug in unchanged:

    init(prompt_messages) -> (messages, info)
    step(action_text)     -> {"observations": [messages], "reward": float, "done": bool, "metadata": {...}}
    close()

Observation segments are not actions (no log-probability, coefficient or critic loss); each step's reward lands on
the last action token of its turn. Read when present: ``stop_strings``, and ``tool_calls``/``tool_errors`` metadata.
Deliberately left out: tool registries and sandboxes, asynchronous environments, anything that needs the network.
Design notes: docs/design/environment.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypedDict

Message = dict[str, str]  # {"role": ..., "content": ...}


class StepOutput(TypedDict, total=False):
    observations: list[Message]
    reward: float
    done: bool
    metadata: dict[str, Any]


class TextEnv(Protocol):
    """A text environment in SkyRL-Gym's shape."""

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]: ...

    def step(self, action: str) -> StepOutput: ...

    def close(self) -> None: ...


# Builds one environment for one task: (task id, the task's fields such as {"answer": "18"}) -> TextEnv.
EnvFactory = Callable[[str, dict[str, Any]], TextEnv]


SENTINEL = "\u0000sao-action\u0000"


def render_observation(tokenizer: Any, observations: list[Message], eos_text: str | None) -> str:
    """The text that follows an action in the chat template: the rest of the assistant turn's closing, the
    observation messages, and the next assistant header.

    Rendered as the difference of two template calls around a sentinel action, so that whatever the template
    adds (Qwen2.5 wraps a "tool" message in ``<tool_response>``, a model without tool support gets a plain
    role) comes out exactly as the model would see it in a whole conversation. ``eos_text``: the EOS token's
    text when the action already ended with it (then it is not repeated), None when the action ended at a
    stop string (then the template's own turn closing is kept, as observation text).
    """
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": SENTINEL}]
    full = tokenizer.apply_chat_template([*history, *observations], tokenize=False, add_generation_prompt=True)
    after = full[full.index(SENTINEL) + len(SENTINEL) :]
    if eos_text and after.startswith(eos_text):
        after = after[len(eos_text) :]
    return after
