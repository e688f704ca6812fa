"""The bounded reader (``sao.core.reading``): each hostile input is refused quickly, in bounded memory, with one
line that names the file (and line, and field where known) and is of the caller's error class; what is within
the limits reads back exactly as ``json`` or PyYAML would read it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao.core import reading
from sao.core.errors import ConfigError, DataError
from sao.core.reading import Limits, iter_jsonl, parse_json, parse_jsonl_line, parse_yaml, preview, read_json_file


def one_line(error: BaseException, *parts: str, kind: type = DataError) -> str:
    """The message of ``error``: of type ``kind``, one short line holding every one of ``parts``."""
    message = str(error)
    assert type(error) is kind, f"{type(error).__name__}: {message}"
    assert "\n" not in message and len(message) < 300, message
    for part in parts:
        assert part in message, message
    return message


def refused(call, *parts: str, kind: type = DataError) -> str:
    with pytest.raises(kind) as caught:
        call()
    return one_line(caught.value, *parts, kind=kind)


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def peak_bytes(call) -> int:
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def raises_data_error(call):
    def run():
        with pytest.raises(DataError):
            call()

    return run


# ---------------------------------------------------------------------------------------------------------
# Nesting.


def test_json_nested_a_million_deep_is_refused_before_the_parser_runs(monkeypatch):
    def no_parser(*args, **kwargs):
        raise AssertionError("json.loads was called")

    monkeypatch.setattr(reading.json, "loads", no_parser)
    text = "[" * 10**6
    elapsed = timed(lambda: refused(lambda: parse_json(text, where="deep.json"), "deep.json: nested deeper than 64"))
    assert elapsed < 1.0
    refused(lambda: parse_json('{"a": ' * 10**5, where="deep.json"), "deep.json: nested deeper than 64", "column 385")
    refused(lambda: parse_jsonl_line(b"[" * 10**5, where="log.jsonl:7"), "log.jsonl:7: nested deeper than 64")


def test_json_nesting_is_refused_exactly_past_the_limit():
    assert parse_json("[" * 64 + "]" * 64, where="x.json") == json.loads("[" * 64 + "]" * 64)
    refused(lambda: parse_json("[" * 65 + "]" * 65, where="x.json"), "x.json: nested deeper than 64", "column 65")
    limits = Limits(max_depth=3)
    assert parse_json('{"a": [{"b": 1}]}', where="x.json", limits=limits) == {"a": [{"b": 1}]}
    refused(lambda: parse_json('{"a": [{"b": [1]}]}', where="x.json", limits=limits), "nested deeper than 3")


def test_brackets_inside_strings_are_not_nesting():
    text = json.dumps({"s": "[" * 1000, "t": '\\"{{{' * 100, "u": ["]" * 500, "\\" * 7, '"[']})
    assert parse_json(text, where="x.json") == json.loads(text)
    text = json.dumps([{"a": "]]]]"}] * 3 + ["[" * 100])
    assert parse_json(text, where="x.json") == json.loads(text)


def test_yaml_nested_a_hundred_thousand_deep_is_refused_quickly():
    for text in ("[" * 10**5, "{a: " * 10**5, "- " * 10**5 + "x", "".join(" " * i + f"k{i}:\n" for i in range(500))):
        elapsed = timed(lambda text=text: refused(lambda: parse_yaml(text, where="deep.yaml"), "deep.yaml: nested"))
        assert elapsed < 1.0
    assert parse_yaml("[" * 64 + "]" * 64, where="x.yaml") == json.loads("[" * 64 + "]" * 64)
    refused(lambda: parse_yaml("[" * 65 + "]" * 65, where="x.yaml"), "deeper than 64", "line 1, column 65")


def test_yaml_alias_that_nests_its_anchor_too_deep_is_refused():
    deep = "[" * 60 + "]" * 60
    assert parse_yaml(f"a: &a {deep}\nb: [[*a]]\n", where="c.yaml")["b"][0][0] is not None
    refused(lambda: parse_yaml(f"a: &a {deep}\nb: [[[[[[*a]]]]]]\n", where="c.yaml"), "through an alias", "line 2")


# ---------------------------------------------------------------------------------------------------------
# Numbers that are not numbers.


def test_integer_of_5000_digits_is_refused_with_its_field():
    digits = "9" * 5000
    refused(lambda: parse_json(f'{{"a": [1, {digits}]}}', where="r.json"), "r.json: field 'a[1]': an integer of 5000")
    line = f'{{"id": -{digits}}}\n'
    refused(lambda: parse_jsonl_line(line, where="t.jsonl:2"), "t.jsonl:2: field 'id'", "(at most 100)")
    refused(lambda: parse_yaml(f"seed: {digits}\n", where="c.yaml"), "c.yaml: an integer of 5000 digits", "line 1")
    refused(lambda: parse_yaml(f"seed: !!int '{digits}'\n", where="c.yaml"), "an integer of 5000 digits")
    assert parse_json(f"[{'9' * 100}]", where="x") == [int("9" * 100)]
    refused(lambda: parse_json(f"[{'9' * 101}]", where="x"), "field '[0]': an integer of 101 digits")
    assert parse_json(f"[{'1' * 150}]", where="x", limits=Limits(max_int_digits=200)) == [int("1" * 150)]


@pytest.mark.parametrize(
    "text, part",
    [
        ('{"lr": NaN}', "field 'lr': NaN is not a number"),
        ('{"a": {"b": [Infinity]}}', "field 'a.b[0]': Infinity is not a number"),
        ("[-Infinity]", "field '[0]': -Infinity"),
        ('{"lr": 1e400}', "field 'lr': '1e400' is beyond the range of a float"),
        ('{"lr": -1E+309}', "'-1E+309' is beyond"),
        (f'{{"x": {"1" * 400}.5}}', "beyond the range of a float"),
        (f'{{"x": {"1" * 250}e99}}', "beyond the range of a float"),
    ],
    ids=["NaN", "Infinity", "-Infinity", "1e400", "-1E+309", "400-digit mantissa", "250 digits e99"],
)
def test_json_nan_infinity_and_overflowing_numbers_are_refused(text, part):
    refused(lambda: parse_json(text, where="m.json", limits=Limits(max_int_digits=4000)), "m.json: ", part)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.Inf", "1e400", "-1.0e+999", "1_0e400"])
def test_yaml_nan_infinity_and_overflowing_numbers_are_refused(value):
    refused(lambda: parse_yaml(f"lr: {value}\n", where="c.yaml"), "c.yaml: ", "is not a finite number", "column 5")


def test_hex_digests_and_numbers_in_strings_read_as_they_are():
    value = {"sha": "0e789" * 20 + "1e400", "ids": "9" * 300, "n": [1e-300, 1.5e99, -0.0, 10**99]}
    assert parse_json(json.dumps(value), where="x") == value


# ---------------------------------------------------------------------------------------------------------
# YAML aliases.


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    for level in range(1, levels):
        lines.append(f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_is_refused_in_under_a_second_and_bounded_memory():
    bomb = _alias_bomb()  # 9 ** 9 = 387 million values from 72 aliases in 500 bytes
    assert len(bomb) < 1000 and bomb.count("*") < 100
    call = raises_data_error(lambda: parse_yaml(bomb, where="--config c.yaml"))
    assert timed(call) < 1.0
    assert peak_bytes(call) < 5 << 20
    refused(lambda: parse_yaml(bomb, where="--config c.yaml"), "--config c.yaml: stands for more than 10000000 values")
    tight = Limits(max_nodes=1000)
    refused(lambda: parse_yaml(_alias_bomb(4), where="c.yaml", limits=tight), "more than 1000 values", "line 4")


def test_yaml_aliases_are_counted_and_a_self_containing_one_is_refused():
    plenty = "a: &a x\nb: [" + ", ".join(["*a"] * 100) + "]\n"
    assert parse_yaml(plenty, where="c.yaml")["b"] == ["x"] * 100
    refused(lambda: parse_yaml(plenty.replace("]", ", *a]"), where="c.yaml"), "more than 100 aliases", "line 2")
    refused(lambda: parse_yaml("a: &a [1, *a]\n", where="c.yaml"), "a structure that contains itself")


def test_yaml_merge_keys_still_merge_within_the_limits():
    text = "base: &base {lr: 1e-5, lag: 2}\nrun: {<<: *base, lag: 4}\n"
    assert parse_yaml(text, where="c.yaml") == {"base": {"lr": 1e-5, "lag": 2}, "run": {"lr": 1e-5, "lag": 4}}


# ---------------------------------------------------------------------------------------------------------
# JSONL files.


def test_a_5_mb_line_under_a_1_mib_bound_is_read_lazily_and_skipped(tmp_path):
    path = tmp_path / "big.jsonl"
    with path.open("wb") as handle:
        handle.write(b'{"id": 1}\n')
        handle.write(b'{"pad": "' + b"x" * (5 << 20) + b'"}\n')
        handle.write(b'{"id": 3}\n')
    limits = Limits(max_bytes=1 << 20)
    rows = []
    peak = peak_bytes(lambda: rows.extend(iter_jsonl(path, limits=limits)))
    assert peak < (1 << 20) * 2.5  # one bounded line and its chunks, never the 5 MB
    assert [line for line, _ in rows] == [1, 2, 3]
    assert rows[0][1] == {"id": 1} and rows[2][1] == {"id": 3}
    one_line(rows[1][1], f"{path}:2: longer than 1 MiB")


def test_a_line_of_exactly_the_bound_is_read_and_one_byte_more_is_not(tmp_path):
    path = tmp_path / "edge.jsonl"
    fits = b'["' + b"x" * 96 + b'"]'  # 100 bytes
    path.write_bytes(fits + b"\n" + fits[:-1] + b'x"]\n' + fits)
    rows = list(iter_jsonl(path, limits=Limits(max_bytes=100)))
    assert rows[0] == (1, ["x" * 96]) and rows[2] == (3, ["x" * 96])
    one_line(rows[1][1], f"{path}:2: longer than 100 bytes")


def test_a_bad_line_can_be_skipped_and_the_good_lines_after_it_still_read(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"id": "a"}\n'  # a byte order mark on the first line is allowed
        b'{"id": "b", \n'  # cut short
        b"\n"  # blank: not a record, still a line
        b'{"id": "c", "reward": NaN}\n'
        b'{"id": "\xff"}\n'
        b'{"id": "d"}\n'
        b'{"id": "e"}'  # no newline at the end
    )
    rows = list(iter_jsonl(path))
    assert [line for line, _ in rows] == [1, 2, 4, 5, 6, 7]
    good = [value["id"] for _, value in rows if not isinstance(value, Exception)]
    assert good == ["a", "d", "e"]
    one_line(rows[1][1], f"{path}:2: not valid JSON", "at column")
    one_line(rows[2][1], f"{path}:4: field 'reward': NaN is not a number")
    one_line(rows[3][1], f"{path}:5: not UTF-8 text")


def test_jsonl_errors_take_the_callers_format_and_class(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"q": 1}\n[1,\n')
    rows = list(iter_jsonl(path, where="{path} line {line}", error=ConfigError))
    assert rows[0] == (1, {"q": 1})
    one_line(rows[1][1], f"{path} line 2: not valid JSON", kind=ConfigError)
    refused(lambda: list(iter_jsonl(tmp_path / "missing.jsonl")), "missing.jsonl: no such file")


def test_bad_utf8_is_one_line_naming_the_file_or_line(tmp_path):
    refused(lambda: parse_jsonl_line(b'{"a": "\xc3("}', where="t.jsonl:9"), "t.jsonl:9: not UTF-8 text", "at byte 7")
    path = tmp_path / "results.json"
    path.write_bytes(b'{"a": "\xff"}')
    refused(lambda: read_json_file(path), f"{path}: not UTF-8 text")
    refused(lambda: parse_yaml(b"a: \xff\n", where="c.yaml", error=ConfigError), "c.yaml: not UTF-8", kind=ConfigError)


# ---------------------------------------------------------------------------------------------------------
# Whole files.


def test_read_json_file_reads_at_most_the_bound_and_checks_the_top_level(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"runs": [1, 2]}))
    assert read_json_file(path) == {"runs": [1, 2]}
    refused(lambda: read_json_file(path, expect=list), f"{path}: holds an object at the top level, not a list")
    assert read_json_file(path, expect=(list, dict)) == {"runs": [1, 2]}
    big = tmp_path / "big.json"
    big.write_bytes(b"[" + b"0," * (3 << 20) + b"0]")
    peak = peak_bytes(raises_data_error(lambda: read_json_file(big, limits=Limits(max_bytes=1 << 20), expect=list)))
    assert peak < 3 << 20
    refused(lambda: read_json_file(big, limits=Limits(max_bytes=1 << 20)), f"{big}: longer than 1 MiB")
    refused(lambda: read_json_file(tmp_path / "none.json"), "none.json: no such file")
    refused(lambda: read_json_file(tmp_path), f"{tmp_path}: is a folder, not a file")
    config = tmp_path / "c.json"
    config.write_text('{"lr": 1e-5,\n "lag": }')
    where = f"--config {config}"
    refused(
        lambda: read_json_file(config, where=where, error=ConfigError),
        f"{where}: not valid JSON (Expecting value at line 2, column 9)",
        kind=ConfigError,
    )


def test_too_many_values_or_too_long_a_string_is_refused():
    few = Limits(max_nodes=100)
    refused(lambda: parse_json("[" + "0," * 200 + "0]", where="x", limits=few), "x: holds more than 100 values")
    refused(lambda: parse_yaml("[" + "0, " * 200 + "0]", where="x", limits=few), "x: stands for more than 100 values")
    small = Limits(max_string=50)
    text = json.dumps({"messages": [{"content": "y" * 51}]})
    refused(lambda: parse_json(text, where="t:1", limits=small), "t:1: field 'messages[0].content': a string of 51")
    escaped = json.dumps({"s": '"' * 40})  # 80 bytes of escapes, 40 characters
    assert parse_json(escaped, where="x", limits=small) == {"s": '"' * 40}
    refused(lambda: parse_yaml(f"k: {'z' * 51}\n", where="c.yaml", limits=small), "a string of 51 characters")


def test_syntax_errors_name_line_and_column():
    refused(lambda: parse_json('{"a": 1,\n  "b" 2}', where="x.json"), "x.json: not valid JSON", "line 2, column 7")
    refused(lambda: parse_jsonl_line('{"a" 1}', where="x.jsonl:4"), "x.jsonl:4: not valid JSON", "at column 6")
    refused(lambda: parse_yaml("a: [1,\nb: 2\n", where="c.yaml"), "c.yaml: not valid YAML", "line 3, column 1")
    refused(lambda: parse_yaml("a: 2024-13-01\n", where="c.yaml"), "c.yaml: not valid YAML: month must be in 1..12")


def test_yaml_reads_plain_data_and_1e_5_as_a_float():
    text = "lr: 1e-5\nlags: [0, 2]\nband: [0.7, 6.0]\nname: run\nnote: null\nfast: true\n"
    value = parse_yaml(text, where="c.yaml")
    assert value == {"lr": 1e-5, "lags": [0, 2], "band": [0.7, 6.0], "name": "run", "note": None, "fast": True}
    refused(lambda: parse_yaml("a: !!python/object:os.system x", where="c.yaml"), "c.yaml: not valid YAML")
    refused(lambda: parse_yaml("a: 1\n---\nb: 2\n", where="c.yaml"), "c.yaml: not valid YAML")


# ---------------------------------------------------------------------------------------------------------
# Quoting values.


def test_messages_quote_a_short_prefix_of_a_hostile_value():
    assert len(preview("9" * 10**7)) == 61 and preview("9" * 10**7).endswith("…")
    nested: list = []
    for _ in range(10**5):
        nested = [nested]
    looped: list = [1]
    looped.append(looped)
    assert len(preview(nested)) == 61 and preview(nested).startswith("[[[[")
    assert len(preview(looped)) == 61 and preview(looped).startswith("[1, [1, [1")
    assert preview(10**5000) == "<an integer of about 5001 digits>"
    assert preview({"a": [1, "b"], "c": None}) == "{'a': [1, 'b'], 'c': None}"


# ---------------------------------------------------------------------------------------------------------
# What is within the limits reads back as it was.

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=JSON_VALUES, indent=st.sampled_from([None, 1]), ascii_only=st.booleans())
def test_any_json_within_the_limits_reads_back_as_written(value, indent, ascii_only):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    assert parse_json(text, where="x.json") == value
    assert parse_json(text.encode(), where="x.json") == value
    assert parse_jsonl_line(json.dumps(value, ensure_ascii=ascii_only) + "\n", where="x.jsonl:1") == value


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


TRICKY_VALUES = st.recursive(
    st.none() | st.integers(-5, 5) | st.text(alphabet='[]{}",:\\ab', max_size=6),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text('[{\\"a', max_size=3), children, max_size=3)
    ),
    max_leaves=12,
)


def _every_value(pairs: list[tuple[str, object]]) -> dict[int, object]:
    return dict(enumerate(value for _, value in pairs))


@settings(max_examples=500, deadline=None)
@given(
    value=TRICKY_VALUES,
    edit=st.sampled_from(["none", "insert", "delete", "cut"]),
    at=st.integers(0, 10**4),
    char=st.sampled_from(list('[]{}",:\\ ')),
)
def test_json_and_broken_json_read_as_json_would_or_are_one_line_refused(value, edit, at, char):
    """The scan before parsing never refuses what json reads within the limits, and json never nests deeper
    than the scan allowed: strings full of brackets, quotes and backslashes, whole or with one character
    inserted, deleted or the rest cut off, either read exactly as json.loads reads them or are a DataError."""
    text = json.dumps(value)
    at %= len(text) + 1
    text = {"none": text, "insert": text[:at] + char + text[at:], "delete": text[:at] + text[at + 1 :]}.get(
        edit, text[:at]
    )
    try:
        expected = json.loads(text)
    except ValueError:
        expected = ValueError
    try:
        read = parse_json(text, where="x.json", limits=Limits(max_depth=3))
    except DataError as error:
        one_line(error, "x.json: ")
        # the depth of the text, every value kept (json.loads keeps a duplicated key's last value only)
        assert expected is ValueError or _depth(json.loads(text, object_pairs_hook=_every_value)) > 3
    else:
        assert expected is not ValueError and json.dumps(read) == json.dumps(expected) and _depth(read) <= 3


# ---------------------------------------------------------------------------------------------------------
# The module itself.


def test_limits_are_frozen_and_checked():
    with pytest.raises(ValueError, match="max_depth"):
        Limits(max_depth=0)
    with pytest.raises(ValueError, match="max_int_digits"):
        Limits(max_int_digits=10**6)
    with pytest.raises(AttributeError):
        Limits().max_depth = 5  # type: ignore[misc]
    assert Limits(max_bytes=1 << 20).max_depth == Limits().max_depth


def test_reading_imports_no_torch():
    code = "import sys, sao.core.reading; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_math_is_finite_for_every_accepted_float():
    value = parse_json("[1e308, -1e308, 5e-324, 1.7976931348623157e308]", where="x")
    assert all(math.isfinite(x) for x in value)
