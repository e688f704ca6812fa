"""Reading JSON, JSONL and YAML that anyone may have written: within stated bounds (``Limits``), with one-line errors.

A JSON document or JSONL line is measured before Python parses it, without recursion: its size, its nesting
depth outside strings (a million ``[`` is refused before any parser descends), its count of values and its
longest string. While it is parsed, integers of more than ``max_int_digits`` digits (Python refuses to convert
4300), NaN, Infinity and numbers beyond a float (``1e400``) are refused. YAML is read by a SafeLoader that also
reads ``1e-5`` as a float and counts, while composing, the depth, the aliases and the nodes the document stands
for once its aliases are expanded: an alias bomb is refused before anything is expanded. An error is of the
caller's class (``DataError`` unless told), one line beginning with ``where`` (then the field, when known),
and quotes at most a short prefix of a value (``preview``).

Deliberately left out: what the values mean (callers check their fields and numbers),
duplicate keys (the last wins, as in ``json`` and PyYAML), YAML tags beyond SafeLoader's, and following a
growing log (``iter_jsonl`` reads a file as it is; a last line without its newline is a line).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import re
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from sao.core.errors import DataError, SaoError

PREVIEW_WIDTH = 60  # the most characters of a value an error message quotes


@dataclass(frozen=True)
class Limits:
    """Bounds on what one document or JSONL line may hold. The defaults admit every file sao writes (a
    confirm run's results.json: 7 MB, 440k values, depth 10) with room to spare; a caller that reads
    something smaller (a settings file, a data record) passes its own, e.g. ``Limits(max_bytes=1 << 20)``
    or ``dataclasses.replace(limits, max_depth=16)``."""

    max_bytes: int = 64 << 20  # a file, or one JSONL line (characters when text is given)
    max_depth: int = 64  # nested lists and mappings; sao's own files nest 10 deep
    max_int_digits: int = 100  # an integer's digits: seeds and token ids have 20 at most
    max_string: int = 4 << 20  # characters of one string (a key too): the text of a 1M-token prompt
    max_aliases: int = 100  # YAML aliases (*name) in one document
    max_nodes: int = 10_000_000  # values and keys, YAML aliases counted as what they stand for

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{field.name} must be a whole number >= 1, got {value!r}")
        python_limit = sys.get_int_max_str_digits() or math.inf  # 0: this interpreter has none
        if self.max_int_digits > python_limit:
            raise ValueError(f"Limits.max_int_digits must be at most {python_limit} (Python's own limit)")


LIMITS = Limits()


def preview(value: Any, width: int = PREVIEW_WIDTH) -> str:
    """``repr(value)`` cut to ``width`` characters (then "…"), built piece by piece: a huge, deep or aliased
    value costs no more than the characters shown, and an integer too long to print is described instead."""
    out, size = [], 0
    for piece in _pieces(value, width):
        out.append(piece)
        size += len(piece)
        if size > width:
            return "".join(out)[:width] + "…"
    return "".join(out)


def _pieces(value: Any, width: int) -> Iterator[str]:
    if isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ", " if i else ""
            yield from _pieces(key, width)
            yield ": "
            yield from _pieces(item, width)
        yield "}"
    elif isinstance(value, (list, tuple, set, frozenset)):
        yield "["
        for i, item in enumerate(value):
            yield ", " if i else ""
            yield from _pieces(item, width)
        yield "]"
    elif isinstance(value, (str, bytes)):
        yield repr(value[: width + 1])
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        yield f"<an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits>"
    elif value is None or isinstance(value, (bool, int, float)):
        yield repr(value)
    else:
        yield f"<{type(value).__name__}>"  # its repr could be anything, of any size


def _problem(error: type[SaoError], where: str, problem: str, path: tuple[Any, ...] = ()) -> SaoError:
    field = f"field '{_field_name(path)}': " if path else ""
    return error(f"{where}: {field}{problem}")


def _field_name(path: tuple[Any, ...]) -> str:
    """``("choices", 0, "logprobs")`` → ``choices[0].logprobs``; odd keys are quoted and cut short."""
    parts = []
    for step in path:
        if isinstance(step, int):
            parts.append(f"[{step}]")
        elif isinstance(step, str) and step.isidentifier() and len(step) <= 30:
            parts.append(f".{step}" if parts else step)
        else:
            parts.append(f"[{preview(step, 30)}]")
    name = "".join(parts)
    return name if len(name) <= 100 else "…" + name[-99:]


# --- JSON -------------------------------------------------------------------------------------------------

# The scan before parsing works on bytes with C-speed passes: the escapes \\ and \" become one letter, every
# byte but brackets, quotes, commas and colons is deleted, strings (now quotes around at most those) are
# removed, and what is left is counted. Where the text is not JSON the scan may be wrong, but only after the first
# point that json stops at, so that json never nests deeper than the scan measured.
_DELETE = bytes(sorted(set(range(256)) - set(b'[]{}",:')))
_QUOTED = re.compile(rb'"[^"]*"?')
# Digits, e, signs and what ends a number (, ] } and white space) as four classes; anything else a space.
_NUMBER_SHAPE = bytearray(b" " * 256)
for _chars, _class in ((b"0123456789", b"0"), (b"eE", b"e"), (b"+-", b"+"), (b",]} \t\r\n", b",")):
    for _char in _chars:
        _NUMBER_SHAPE[_char] = _class[0]
_BIG_EXPONENT = re.compile(rb"0e\+?000+(?:,|\Z)")  # as a JSON number ends: a hex digest in a string rarely does
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
# For the error message only: where the nesting first passes the limit, token by token.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)
_CHAR_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


@functools.lru_cache(maxsize=8)
def _longer_string(max_string: int) -> re.Pattern[bytes]:
    return re.compile(rb'"[^"]{%d}' % (max_string + 1))


def _odd_numbers(data: bytes, digits: int) -> bool:
    """Whether ``data`` may hold a number with more than ``digits`` digits in a row or an exponent of three
    digits or more (strings are not told apart: there it is only a false alarm, which costs time)."""
    shape = data.translate(_NUMBER_SHAPE)
    return b"0" * (digits + 1) in shape or _BIG_EXPONENT.search(shape) is not None


class _Refused:
    """Stands in, while ``json`` parses, for a number it must not hold; the error names its field after."""

    __slots__ = ("problem",)

    def __init__(self, problem: str) -> None:
        self.problem = problem


def parse_json(text: str | bytes, *, where: str, limits: Limits = LIMITS, error: type[SaoError] = DataError) -> Any:
    """One JSON document (a leading UTF-8 byte order mark is allowed), checked against ``limits``."""
    text, data = _text(text, where, limits, error, "utf-8-sig")
    try:
        return _parse(text.removeprefix("\ufeff"), data, where, limits, error)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def parse_jsonl_line(
    raw: str | bytes, *, where: str, limits: Limits = LIMITS, error: type[SaoError] = DataError
) -> Any:
    """One line of a JSONL file (its newline may be there), checked against ``limits``; ``where`` names the
    file and line (``iter_jsonl`` says ``FILE:LINE``), and a syntax error its column."""
    text, data = _text(raw, where, limits, error, "utf-8")
    try:
        return _parse(text, data, where, limits, error)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None


def _text(raw: str | bytes, where: str, limits: Limits, error: type[SaoError], encoding: str) -> tuple[str, bytes]:
    """The text and its UTF-8 bytes, within ``limits.max_bytes`` (characters, when text is given)."""
    if len(raw) > limits.max_bytes:
        raise error(f"{where}: longer than {_size(limits.max_bytes)} (is this the right file?)")
    if isinstance(raw, str):
        return raw, raw.encode("utf-8", "surrogatepass")
    try:
        return bytes(raw).decode(encoding), bytes(raw)
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _parse(text: str, data: bytes, where: str, limits: Limits, error: type[SaoError]) -> Any:
    """``text`` (and ``data``, the same as UTF-8) parsed, once its shape is checked without recursion."""
    if b"\\" in data:  # \\ and \" become one letter: a string's bytes are still at least its characters
        data = data.replace(b"\\\\", b"e").replace(b'\\"', b"e")
    long_strings = len(data) > limits.max_string + 2 and _longer_string(limits.max_string).search(data) is not None
    # Numbers of at most 200 digits in a row and exponents below 100 are within a float: no Python hook per number.
    odd_numbers = _odd_numbers(data, min(limits.max_int_digits, 200))
    kept = data.translate(None, _DELETE).replace(b'""', b"")
    if b'"' in kept:
        kept = _QUOTED.sub(b"", kept)
    separators = kept.count(b",") + kept.count(b":")
    brackets = kept.translate(None, b",:")
    del data, kept
    opened = brackets.count(b"[") + brackets.count(b"{")
    if opened > limits.max_depth and next(filter(limits.max_depth.__lt__, _depths(brackets)), None) is not None:
        raise error(f"{where}: nested deeper than {limits.max_depth} lists and objects{_too_deep_at(text, limits)}")
    if 1 + separators + opened > limits.max_nodes:  # values and keys, an empty list or object counted twice
        raise error(f"{where}: holds more than {limits.max_nodes} values and keys")
    refused: list[_Refused] = []

    def refuse(problem: str) -> _Refused:
        refused.append(_Refused(problem))
        return refused[-1]

    def parse_int(digits: str) -> int | _Refused:
        count = len(digits) - digits.startswith("-")
        if count > limits.max_int_digits:
            return refuse(f"an integer of {count} digits (at most {limits.max_int_digits})")
        return int(digits)

    def parse_float(literal: str) -> float | _Refused:
        value = float(literal)
        return value if math.isfinite(value) else refuse(f"{preview(literal, 30)} is beyond the range of a float")

    def parse_constant(name: str) -> _Refused:
        return refuse(f"{name} is not a number (JSON has no NaN or Infinity)")

    if odd_numbers:
        value = json.loads(text, parse_int=parse_int, parse_float=parse_float, parse_constant=parse_constant)
    else:
        value = json.loads(text, parse_constant=parse_constant)
    if refused or long_strings:
        for path, item in _walk(value):
            if isinstance(item, _Refused):
                raise _problem(error, where, item.problem, path)
            if isinstance(item, str) and len(item) > limits.max_string:
                raise _problem(error, where, f"a string of {len(item)} characters (at most {limits.max_string})", path)
    return value


def _depths(brackets: bytes) -> Iterator[int]:
    return itertools.accumulate(map(_STEP.__getitem__, brackets))


def _too_deep_at(text: str, limits: Limits) -> str:
    """Where the nesting first passes the limit (the error path only: this scans token by token)."""
    depth = 0
    for match in _TOKEN.finditer(text):
        depth += _CHAR_STEP.get(match.group(), 0)
        if depth > limits.max_depth:
            line = text.count("\n", 0, match.start()) + 1
            column = match.start() - (text.rfind("\n", 0, match.start()) + 1) + 1
            return f" at line {line}, column {column}" if line > 1 else f" at column {column}"
    return ""


def _walk(value: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path, item) of every value and key in document order; iterative, so any depth is safe."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        yield path, item
        if isinstance(item, dict):
            for key in item:
                yield (*path, key), key
            stack.extend(((*path, key), child) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend(((*path, i), child) for i, child in reversed(list(enumerate(item))))


# --- files --------------------------------------------------------------------------------------------------

_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null"}


def _kind(value: Any) -> str:
    if type(value) in _KINDS:
        return _KINDS[type(value)]
    return "a number" if isinstance(value, (int, float)) else f"a {type(value).__name__}"


def _open(path: Path, where: str, error: type[SaoError]) -> IO[bytes]:
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise error(f"{where}: no such file") from None
    except IsADirectoryError:
        raise error(f"{where}: is a folder, not a file") from None
    except OSError as e:
        raise error(f"{where}: cannot be read ({e.strerror or e})") from None


def read_json_file(
    path: str | os.PathLike[str],
    *,
    limits: Limits = LIMITS,
    expect: type | tuple[type, ...] = dict,
    where: str | None = None,
    error: type[SaoError] = DataError,
) -> Any:
    """A JSON file whose top level is an ``expect`` (an object unless told), reading at most
    ``limits.max_bytes + 1`` bytes of it; ``where`` (the path unless told) begins every error."""
    path = Path(path)
    where = str(path) if where is None else where
    with _open(path, where, error) as handle:
        try:
            data = handle.read(limits.max_bytes + 1)
        except OSError as e:
            raise error(f"{where}: cannot be read ({e.strerror or e})") from None
    value = parse_json(data, where=where, limits=limits, error=error)
    if not isinstance(value, expect):
        wanted = " or ".join(_KINDS.get(t, t.__name__) for t in (expect if isinstance(expect, tuple) else (expect,)))
        raise error(f"{where}: holds {_kind(value)} at the top level, not {wanted}")
    return value


SAFETENSORS_HEADER_LIMITS = Limits(max_bytes=100 << 20)  # safetensors refuses headers over 100 MB itself


def safetensors_problem(path: str | os.PathLike[str]) -> str | None:
    """None when ``path`` is a whole safetensors file: an 8-byte header length, a JSON header that long, and the
    bytes every tensor's ``data_offsets`` reach; otherwise what is wrong, in words (truncated, not safetensors)."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 8:
                return f"truncated: {size} bytes, less than a header"
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > SAFETENSORS_HEADER_LIMITS.max_bytes:
                return f"not a safetensors file (its first 8 bytes give a header of {length} bytes)"
            if 8 + length > size:
                return f"truncated: its header needs {8 + length} bytes, the file holds {size}"
            header = parse_json(handle.read(length), where=os.fspath(path), limits=SAFETENSORS_HEADER_LIMITS)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    except DataError:
        return "not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "not a safetensors file (its header is not a JSON object)"
    ends = [
        info.get("data_offsets", [0, 0])[-1]
        for name, info in header.items()
        if name != "__metadata__" and isinstance(info, dict)
    ]
    need = 8 + length + max((e for e in ends if isinstance(e, int)), default=0)
    if need > size:
        return f"truncated: its tensors need {need} bytes, the file holds {size}"
    return None


def read_bounded_line(handle: IO[bytes], max_bytes: int) -> tuple[bytes, bool]:
    """The next line of a binary file and whether it fits: ``(line, True)`` for at most ``max_bytes`` and
    its newline; for a longer one, ``(its first max_bytes + 1 bytes, False)``, its rest read and dropped in
    chunks so that it is never held whole. ``(b"", True)`` at the end of the file."""
    raw = handle.readline(max_bytes + 1)
    if len(raw) <= max_bytes or raw.endswith(b"\n"):
        return raw, True
    while True:
        rest = handle.readline(1 << 16)
        if not rest or rest.endswith(b"\n"):
            return raw, False


def iter_jsonl(
    path: str | os.PathLike[str],
    *,
    limits: Limits = LIMITS,
    where: str = "{path}:{line}",
    error: type[SaoError] = DataError,
) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` for every non-blank line of a JSONL file, where the value is an instance of
    ``error`` (not raised) when the line is malformed or out of ``limits``: the caller raises it, or counts it
    and reads on. Lines split on ``\\n`` only; each is read up to ``limits.max_bytes + 1`` bytes, never whole;
    the first may begin with a UTF-8 byte order mark. ``where`` is formatted with ``path`` and ``line`` to
    begin each error. A file that cannot be opened is raised, not yielded."""
    path = Path(path)
    with _open(path, str(path), error) as handle:
        for lineno in itertools.count(1):
            here = where.format(path=path, line=lineno)
            try:
                raw, fits = read_bounded_line(handle, limits.max_bytes)
            except OSError as e:
                raise error(f"{here}: cannot be read ({e.strerror or e})") from None
            if not raw:
                return
            if not fits:
                yield lineno, error(f"{here}: longer than {_size(limits.max_bytes)} (is this the right file?)")
                continue
            raw = raw.removesuffix(b"\n")  # the bound is on the line, not its newline
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue
            try:
                yield lineno, parse_jsonl_line(raw, where=here, limits=limits, error=error)
            except error as e:
                yield lineno, e


# --- YAML ---------------------------------------------------------------------------------------------------


class _YamlRefusal(Exception):
    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.mark = problem, mark


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that keeps to ``self.limits``: the scanner refuses deep flow (``[[[``) and block nesting
    before looking ahead (PyYAML's look-ahead over many open brackets is quadratic), the composer refuses
    depth, aliases and nodes as it goes, counting each alias as the nodes it stands for, and the
    constructor refuses long integers and strings and numbers that are not finite."""

    def __init__(self, stream: str, limits: Limits) -> None:
        self.limits = limits
        super().__init__(stream)
        self.depth, self.aliases = 0, 0
        self.sizes: dict[yaml.Node, tuple[int, int]] = {}  # node -> (nodes it stands for, its height)

    # scanner
    def fetch_flow_collection_start(self, token_class: Any) -> None:
        if self.flow_level >= self.limits.max_depth:
            raise _YamlRefusal(f"nested deeper than {self.limits.max_depth} lists and mappings", self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def add_indent(self, column: int) -> bool:
        if len(self.indents) > self.limits.max_depth:
            raise _YamlRefusal(f"nested deeper than {self.limits.max_depth} lists and mappings", self.get_mark())
        return super().add_indent(column)

    # composer
    def compose_node(self, parent: Any, index: Any) -> Any:
        limits = self.limits
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > limits.max_aliases:
                raise _YamlRefusal(f"more than {limits.max_aliases} aliases (*name)", mark)
            node = super().compose_node(parent, index)
            if node not in self.sizes:
                raise _YamlRefusal("an alias inside the node it names (a structure that contains itself)", mark)
            size, height = self.sizes[node]
            if self.depth + height > limits.max_depth:
                raise _YamlRefusal(f"nested deeper than {limits.max_depth} lists and mappings, through an alias", mark)
        else:
            container = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
            self.depth += container
            if self.depth > limits.max_depth:
                raise _YamlRefusal(f"nested deeper than {limits.max_depth} lists and mappings", mark)
            node = super().compose_node(parent, index)
            self.depth -= container
            children = [self.sizes[child] for child in self._children(node)]
            size = 1 + sum(s for s, _ in children)
            height = container + max((h for _, h in children), default=0)
            self.sizes[node] = size, height
        if size > limits.max_nodes:
            raise _YamlRefusal(f"stands for more than {limits.max_nodes} values once its aliases are expanded", mark)
        return node

    @staticmethod
    def _children(node: Any) -> list[Any]:
        if isinstance(node, yaml.SequenceNode):
            return node.value
        if isinstance(node, yaml.MappingNode):
            return [child for pair in node.value for child in pair]
        return []

    # constructor
    def construct_bounded_int(self, node: Any) -> int:
        text = str(self.construct_scalar(node))
        digits = len(text.replace("_", "").lstrip("+-"))
        if digits > self.limits.max_int_digits:
            raise _YamlRefusal(f"an integer of {digits} digits (at most {self.limits.max_int_digits})", node.start_mark)
        return super().construct_yaml_int(node)

    def construct_finite_float(self, node: Any) -> float:
        value = super().construct_yaml_float(node)
        if not math.isfinite(value):
            literal = preview(str(self.construct_scalar(node)), 30)
            raise _YamlRefusal(f"{literal} is not a finite number", node.start_mark)
        return value

    def construct_bounded_str(self, node: Any) -> str:
        value = super().construct_yaml_str(node)
        if len(value) > self.limits.max_string:
            raise _YamlRefusal(
                f"a string of {len(value)} characters (at most {self.limits.max_string})", node.start_mark
            )
        return value


# YAML 1.1 wants a dot and a signed exponent (1.0e-5): without this resolver "1e-5" would be a string, where
# JSON and YAML 1.2 read a number.
_EXPONENT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$|^[-+]?\.[0-9_]+[eE][-+]?[0-9]+$")
_BoundedLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT, list("-+0123456789."))
_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_bounded_int)
_BoundedLoader.add_constructor("tag:yaml.org,2002:float", _BoundedLoader.construct_finite_float)
_BoundedLoader.add_constructor("tag:yaml.org,2002:str", _BoundedLoader.construct_bounded_str)


def parse_yaml(text: str | bytes, *, where: str, limits: Limits = LIMITS, error: type[SaoError] = DataError) -> Any:
    """One YAML document, plain data only (SafeLoader's types, ``1e-5`` a float), checked against ``limits``
    while it is read: an alias bomb is refused before anything is expanded, in time and memory linear in
    the text."""
    text, _ = _text(text, where, limits, error, "utf-8-sig")
    loader = _BoundedLoader(text, limits)
    try:
        return loader.get_single_data()
    except _YamlRefusal as refusal:
        raise error(f"{where}: {refusal.problem}{_at(refusal.mark)}") from None
    except yaml.YAMLError as e:
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise error(f"{where}: not valid YAML: {_cut(problem, 200)}{_at(getattr(e, 'problem_mark', None))}") from None
    except ValueError as e:  # a constructor's own check, such as a date that does not exist (2024-13-01)
        raise error(f"{where}: not valid YAML: {_cut(' '.join(str(e).split()), 200)}") from None
    finally:
        loader.dispose()


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width] + "…"


def _at(mark: Any) -> str:
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


# The one rule for a reward, wherever it comes from: a --reward function, an environment's step, a trace line,
# a feedback request. Rewards are summed over turns and batches in float32: 1e6 is far beyond any task's and
# leaves float32's 3.4e38 unreachable.
REWARD_LIMIT = 1e6


def reward_problem(value: Any) -> str | None:
    """None when ``value`` is a reward: a real number (true/false, a string such as "1" and None are not), finite,
    of magnitude at most ``REWARD_LIMIT``; otherwise what is wrong with it, in words."""
    if value is None or isinstance(value, (bool, str, bytes)):
        return f"a reward must be a number, got {preview(value)}"
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    except (TypeError, ValueError):
        return f"a reward must be a number, got {preview(value)}"
    if not math.isfinite(number) or abs(number) > REWARD_LIMIT:
        return f"a reward must be a finite number of magnitude at most {REWARD_LIMIT:g}, got {preview(value)}"
    return None


# Sampling temperatures taken from outside (a request, a trace): below the least, logits / τ leave float32.
TEMPERATURE_RANGE = (1e-3, 1e3)
