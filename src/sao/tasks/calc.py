"""Calculator environments: a bounded arithmetic tool, the agent that may call it, and GSM8K as an environment.

    calculate(text)  exact arithmetic (``+ - * /``, parentheses, decimals) in ``fractions.Fraction``, parsed here and
                     capped in every dimension; bad input is an ``"error: ..."`` observation, never an exception
    CalcEnv          a TextEnv whose model may call the calculator before its final answer, in the tokenizer's own
                     tool format (``"json"``) or a plain tag (``"tag"``, ``<calc>1234+5678</calc>``)
    Gsm8kEnv         today's single-turn task as an environment: one step, ``grading.reward``, done

Deliberately left out: ``eval``/``exec``/``ast`` of model text, powers, functions, variables, several calls in one
action, and state between steps beyond what a step returns. Design notes: docs/design/calc.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from sao.core.errors import DataError
from sao.core.reading import Limits, parse_json
from sao.rollout.environment import Message, StepOutput
from sao.tasks.gsm8k import grading

__all__ = [
    "CALC_INSTRUCTION",
    "JSON_CALC_INSTRUCTION",
    "MAX_DEPTH",
    "MAX_EXPRESSION_CHARS",
    "MAX_NUMBER_DIGITS",
    "MAX_VALUE_DIGITS",
    "TOOL_FORMATS",
    "TOOL_NAME",
    "TOOL_SCHEMA",
    "CalcEnv",
    "Gsm8kEnv",
    "calc_env_factory",
    "calculate",
    "format_value",
    "tool_format_for",
]

MAX_EXPRESSION_CHARS = 200  # longer expressions are refused before any parsing
MAX_DEPTH = 24  # parentheses and unary signs nested deeper than this are refused
MAX_NUMBER_DIGITS = 30  # digits in one written number
MAX_VALUE_DIGITS = 40  # digits of the numerator and the denominator of every intermediate value
MAX_EXACT_PLACES = 10  # a terminating decimal with at most this many places prints exactly
ROUND_PLACES = 8  # anything else prints rounded to this many places
MAX_CALL_CHARS = 1000  # a JSON tool call longer than this is refused before it is parsed
CALL_LIMITS = Limits(max_bytes=4 * MAX_CALL_CHARS, max_depth=8)  # what a model's tool call may hold

TOOL_NAME = "calculator"
TOOL_FORMATS = ("tag", "json")
TAG_OPEN, TAG_CLOSE = "<calc>", "</calc>"
JSON_OPEN, JSON_CLOSE = "<tool_call>", "</tool_call>"
TOOL_SCHEMA: dict[str, Any] = {  # for apply_chat_template(..., tools=[TOOL_SCHEMA]) in the "json" format
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression exactly: numbers, + - * /, parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (1234+5678)*2/3"}},
            "required": ["expression"],
        },
    },
}
CALC_INSTRUCTION = (  # appended to a question when the tool is a plain tag
    "You may use a calculator: write <calc>EXPRESSION</calc> and its result comes back. "
    'On the last line, write only the final answer in the form "#### N".'
)
JSON_CALC_INSTRUCTION = (  # the same when the chat template carries the tool (pass tools=[TOOL_SCHEMA])
    "You may call the calculator tool for any arithmetic. "
    'On the last line, write only the final answer in the form "#### N".'
)

_LIMIT = 10**MAX_VALUE_DIGITS
_MULTIPLY = "*x×·"
_DIVIDE = "/÷"
_MINUS = "-−"
# A number: thousands groups (1,234,567) or plain digits, an optional decimal part; or a bare decimal part.
_NUMBER = re.compile(r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+")


class _Refused(Exception):
    """Why an expression has no value; its message is the observation after "error: "."""


class _Parser:
    """Recursive descent over the grammar, spaces skipped:

        expression := term (("+" | "-") term)*
        term       := signed (("*" | "/") signed)*
        signed     := ("+" | "-") signed | atom
        atom       := number | "(" expression ")"

    Depth (parentheses and signs together) is capped at MAX_DEPTH, so the recursion is too.
    """

    def __init__(self, text: str):
        self.text, self.at, self.depth = text, 0, 0

    def peek(self) -> str:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1
        return self.text[self.at] if self.at < len(self.text) else ""

    def expression(self) -> Fraction:
        value = self.term()
        while (op := self.peek()) and (op == "+" or op in _MINUS):
            self.at += 1
            right = self.term()
            value = _checked(value + right if op == "+" else value - right)
        return value

    def term(self) -> Fraction:
        value = self.signed()
        while (op := self.peek()) and (op in _MULTIPLY or op in _DIVIDE):
            self.at += 1
            if op == "*" and self.peek() == "*":
                raise _Refused("exponentiation is not supported")
            right = self.signed()
            if op in _DIVIDE:
                if right == 0:
                    raise _Refused("division by zero")
                value = _checked(value / right)
            else:
                value = _checked(value * right)
        return value

    def signed(self) -> Fraction:
        sign = self.peek()
        if sign == "+" or (sign and sign in _MINUS):
            self.at += 1
            with self.nested():
                value = self.signed()
            return -value if sign != "+" else value
        return self.atom()

    def atom(self) -> Fraction:
        char = self.peek()
        if char == "(":
            self.at += 1
            with self.nested():
                value = self.expression()
            if self.peek() != ")":
                raise _Refused("unbalanced parenthesis")
            self.at += 1
            return value
        if char == "$":  # a currency sign in front of a number is read as the number
            self.at += 1
            char = self.peek()
        match = _NUMBER.match(self.text, self.at)
        if match is None:
            if not char:
                raise _Refused("unexpected end of expression")
            if char == ")":
                raise _Refused("unbalanced parenthesis")
            raise _Refused(f"unexpected {char!r} at position {self.at + 1}")
        self.at = match.end()
        written = match[0].replace(",", "")
        whole, _, decimals = written.partition(".")
        if len(whole) + len(decimals) > MAX_NUMBER_DIGITS:
            raise _Refused(f"number longer than {MAX_NUMBER_DIGITS} digits")
        return Fraction(int(whole + decimals or "0"), 10 ** len(decimals))

    def nested(self) -> _Depth:
        return _Depth(self)


class _Depth:
    def __init__(self, parser: _Parser):
        self.parser = parser

    def __enter__(self) -> None:
        self.parser.depth += 1
        if self.parser.depth > MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH}")

    def __exit__(self, *exc: object) -> None:
        self.parser.depth -= 1


def _checked(value: Fraction) -> Fraction:
    if abs(value.numerator) >= _LIMIT or value.denominator >= _LIMIT:
        raise _Refused(f"number too large (more than {MAX_VALUE_DIGITS} digits)")
    return value


def format_value(value: Fraction) -> str:
    """An integer as itself; a terminating decimal of up to MAX_EXACT_PLACES places exactly; anything else
    rounded (half to even) to ROUND_PLACES places, trailing zeros dropped ("0.33333333" for 1/3)."""
    rest, twos, fives = value.denominator, 0, 0
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    places = max(twos, fives)
    shown = value
    if rest != 1 or places > MAX_EXACT_PLACES:
        shown, places = round(value, ROUND_PLACES), ROUND_PLACES
    if shown.denominator == 1:
        return str(shown.numerator)
    digits = str(abs(shown.numerator) * 10**places // shown.denominator).rjust(places + 1, "0")
    text = f"{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".")
    return ("-" if shown < 0 else "") + text


def calculate(expression: object) -> str:
    """The value of an arithmetic expression as text, or ``"error: <why>"``. Never raises, never evaluates
    anything but the grammar of :class:`_Parser`; a trailing ``=`` is allowed ("2+3=")."""
    if not isinstance(expression, str):
        return "error: the expression must be a string"
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    text = expression.strip().removesuffix("=").strip()
    if not text:
        return "error: empty expression"
    if "^" in text:
        return "error: exponentiation is not supported"
    parser = _Parser(text)
    try:
        value = parser.expression()
        rest = parser.peek()
        if rest == ")":
            return "error: unbalanced parenthesis"
        if rest:
            return f"error: unexpected {rest!r} at position {parser.at + 1}"
    except _Refused as why:
        return f"error: {why}"
    return format_value(value)


# --- the environments ----------------------------------------------------------------------------------


def tool_format_for(tokenizer: Any) -> str:
    """``"json"`` when the tokenizer's chat template renders tools (Qwen2.5's does), else ``"tag"``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: any of them
        template = " ".join(str(t) for t in template.values())
    return "json" if isinstance(template, str) and "tools" in template else "tag"


def _find_call(action: str, tool_format: str) -> tuple[bool, str | None, str]:
    """(is a call, the expression or None, the error when it is a malformed call)."""
    opening, closing = (TAG_OPEN, TAG_CLOSE) if tool_format == "tag" else (JSON_OPEN, JSON_CLOSE)
    start = action.find(opening)
    if start < 0:
        return False, None, ""
    end = action.find(closing, start + len(opening))
    if end < 0:
        return True, None, f"error: {opening} without {closing}"
    body = action[start + len(opening) : end]
    if tool_format == "tag":
        return True, body, ""
    if len(body) > MAX_CALL_CHARS:
        return True, None, f"error: tool call longer than {MAX_CALL_CHARS} characters"
    try:
        call = parse_json(body, where="the tool call", limits=CALL_LIMITS)
    except DataError:
        return True, None, "error: the tool call is not valid JSON"
    if not isinstance(call, dict):
        return True, None, 'error: the tool call must be a JSON object with "name" and "arguments"'
    if call.get("name") != TOOL_NAME:
        return True, None, f"error: unknown tool {str(call.get('name'))[:40]!r}; the only tool is {TOOL_NAME!r}"
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = parse_json(arguments, where="the arguments", limits=CALL_LIMITS)
        except DataError:
            return True, None, "error: the arguments are not valid JSON"
    if not isinstance(arguments, dict) or not isinstance(arguments.get("expression"), str):
        return True, None, 'error: the arguments must be {"expression": "..."}'
    return True, arguments["expression"], ""


class CalcEnv:
    """A question with a numeric gold answer and a calculator the model may call before answering.

    ``fields`` holds at least "answer" (the gold, graded by ``sao.tasks.gsm8k.grading``) and "question".
    ``tool_format``: "tag" (``<calc>EXPR</calc>``) or "json" (``<tool_call>{...}</tool_call>``).
    A step whose action holds a call (well-formed or not) answers with one "tool" message, reward 0, not
    done; any other action is the final answer: reward = ``grading.reward(action, gold)``, done.
    """

    def __init__(self, task_id: str, fields: dict[str, Any], *, tool_format: str):
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
        if "answer" not in fields:
            raise ValueError(f"task {task_id!r}: CalcEnv needs an 'answer' field (the gold)")
        self.task_id = task_id
        self.gold = str(fields["answer"])
        self.question = str(fields.get("question", ""))
        self.tool_format = tool_format
        self.stop_strings = [TAG_CLOSE if tool_format == "tag" else JSON_CLOSE]
        self.tools = [TOOL_SCHEMA] if tool_format == "json" else []

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        return list(prompt), {"tools": self.tools}

    def step(self, action: str) -> StepOutput:
        is_call, expression, error = _find_call(action, self.tool_format)
        if not is_call:
            reward = grading.reward(action, self.gold)
            return {"observations": [], "reward": reward, "done": True, "metadata": _counts(0, 0)}
        result = error if expression is None else calculate(expression)
        failed = result.startswith("error:")
        return {
            "observations": [{"role": "tool", "content": result}],
            "reward": 0.0,
            "done": False,
            "metadata": _counts(1, int(failed)),
        }

    def close(self) -> None:
        pass


class Gsm8kEnv:
    """One reply graded by ``grading.reward`` against ``fields["answer"]``: the single-turn task, unchanged."""

    def __init__(self, task_id: str, fields: dict[str, Any]):
        if "answer" not in fields:
            raise ValueError(f"task {task_id!r}: Gsm8kEnv needs an 'answer' field (the gold)")
        self.task_id = task_id
        self.gold = str(fields["answer"])

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        return list(prompt), {}

    def step(self, action: str) -> StepOutput:
        reward = grading.reward(action, self.gold)
        return {"observations": [], "reward": reward, "done": True, "metadata": _counts(0, 0)}

    def close(self) -> None:
        pass


def _counts(calls: int, errors: int) -> dict[str, int]:
    return {"tool_calls": calls, "tool_errors": errors}


def calc_env_factory(tokenizer: Any) -> Callable[[str, dict[str, Any]], CalcEnv]:
    """An ``EnvFactory`` building CalcEnvs in the tokenizer's tool format (decided once, here)."""
    tool_format = tool_format_for(tokenizer)

    def build(task_id: str, fields: dict[str, Any]) -> CalcEnv:
        return CalcEnv(task_id, fields, tool_format=tool_format)

    return build
