"""Tasks: what the model is asked and how its answers are scored — the generic ``Task`` and ``TaskSet``
(``base``), GSM8K (``gsm8k``: data and grader), your own data, reward and environment (``custom``), the
calculator tool (``calc``) and the environments a run can name (``environments``)."""

from __future__ import annotations

from sao.tasks.base import Task, TaskSet
from sao.tasks.custom import load_env_class, load_reward

__all__ = ["Task", "TaskSet", "load_env_class", "load_reward"]
