"""sao.core.grading: the GSM8K reward. Real gold answers, hard replies, fuzzing, hostile inputs, a time bound."""

from __future__ import annotations

import ast
import json
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sao.core.grading as grading
from grading_corpus import NASTY
from sao.core.grading import MAX_DIGITS, WINDOW, extract_answer, math_equal, reward

GSM8K_TEST = Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "test.jsonl"
TIME_BOUND_S = 0.05  # the bound the module docstring states, per call


def _gold_rows(n: int = 300) -> list[tuple[str, str]]:
    rows = []
    with GSM8K_TEST.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                answer = json.loads(line)["answer"]
                rows.append((answer, answer.rsplit("####", 1)[1].strip()))
            if len(rows) == n:
                break
    return rows


GOLD = _gold_rows()


# 1. Real GSM8K gold answers -------------------------------------------------------------------------


def test_gold_file_is_the_real_one():
    assert len(GOLD) == 300
    assert GOLD[0][1] == "18"
    assert any("," in number for _, number in GOLD)  # the table exercises thousands separators


@pytest.mark.parametrize(("field", "number"), GOLD, ids=[f"row{i}" for i in range(len(GOLD))])
def test_gsm8k_gold_grading_table(field, number):
    n = int(number.replace(",", ""))
    assert extract_answer(field) == str(n)
    assert extract_answer(number) == str(n)
    # the whole worked solution against the bare gold, and the reverse
    assert math_equal(field, number)
    assert math_equal(number, field)
    assert reward(field, number) == 1.0
    right = [
        f"The answer is {n}",
        f"So the final answer is: {n}.",
        f"Some work 1 + 2 = 3.\n\\boxed{{{n}}}",
        f"#### {n:,}",
        f"#### ${n:,}",
        f"The total is ${n:,}.00.",
        f"\\boxed{{\\${n}}}",
        f"#### {n}.00",
        f"{n:,} dollars",
    ]
    for reply in right:
        assert math_equal(reply, number), reply
        assert reward(reply, field) == 1.0, reply
    wrong = [
        f"The answer is {n + 1}",
        f"#### {n + 1}",
        f"\\boxed{{{n - 1}}}",
        f"#### {n}.5",
        f"#### {n}\n\\boxed{{{n + 1}}}",  # the later marker wins
        f"#### {-n if n else 1}",
        "I do not know.",
        "",
    ]
    for reply in wrong:
        assert not math_equal(reply, number), reply
        assert reward(reply, field) == 0.0, reply


# 2. Hard replies, hand-written ----------------------------------------------------------------------

HARD = [
    # markers and phrases
    ("#### 18", "18"),
    ("#### $1,234.50", "1234.5"),
    ("####18", "18"),
    ("#### **18**", "18"),
    ("#### 18 eggs", "18"),
    ("The answer is 18.", "18"),
    ("the final answer is: 18", "18"),
    ("**Final Answer:** $18", "18"),
    ("Answer = 7", "7"),
    ("The answer would be 12 apples.", "12"),
    ("ANSWER IS 42", "42"),
    (r"\boxed{18}", "18"),
    (r"\boxed{\$18}", "18"),
    (r"\boxed{18 \text{ dollars}}", "18"),
    (r"$\boxed{1{,}234}$", "1234"),
    (r"\boxed{1\,234}", "1234"),
    (r"\fbox{5}", "5"),
    (r"\boxed {5}", "5"),
    (r"\boxed{\boxed{7}}", "7"),
    (r"\boxed{9 \times 2 = 18}", "18"),
    ("#### 9 * 2 = 18", "18"),
    ("The answer is 9 * 2 = 18.", "18"),
    # several numbers: which one counts
    ("She has 3 cats and 4 dogs, so 7 pets.", "7"),
    ("#### 18\nThat took 3 steps.", "18"),
    (r"\boxed{5} was wrong; the answer is 6", "5"),
    ("The answer is 6. Later: 5 + 1 = 6 and 99 more", "6"),
    ("#### 12\n\\boxed{13}", "13"),
    ("\\boxed{13}\n#### 12", "12"),
    ("#### Step 2: add them\nSo we get 30.", "30"),
    ("#### 1. Compute the eggs\nThe total is \\boxed{18}.", "18"),
    ("The answer is that she has 5 left, and 18 in total", "18"),
    ("The answer is 5. I hope this answer is helpful!", "5"),
    ("The answer is 5. Note this answer is based on 7 days", "5"),
    (r"\boxed{} and then 4", "4"),
    (r"\boxed{18", "18"),
    (r"\boxed{x} 3", "3"),
    ("#### \n12", "12"),
    # number syntax
    ("1,234", "1234"),
    ("1,234,567.89", "1234567.89"),
    ("1, 2, 3", "3"),
    ("1,2,3", "3"),
    ("12,34", "34"),
    ("+5", "5"),
    (".5", "0.5"),
    ("It is 5.", "5"),
    ("18.00", "18"),
    ("0018", "18"),
    ("-5", "-5"),
    ("\u22125", "-5"),
    ("-$5", "-5"),
    ("$-5", "-5"),
    ("10-5", "5"),
    ("3/4", "0.75"),
    ("3 / 4", "0.75"),
    (r"\frac{3}{4}", "0.75"),
    (r"\dfrac{3}{4}", "0.75"),
    (r"\tfrac12", "0.5"),
    (r"-\frac{3}{4}", "-0.75"),
    ("1/3", "1/3"),
    ("-2/6", "-1/3"),
    ("1.5/3", "0.5"),
    ("2/0", None),
    ("2.5e3", "2500"),
    ("1e-2", "0.01"),
    ("18%", "18"),
    ("18th", "18"),
    ("-0", "0"),
    ("x2", None),
    ("v1.2.3", None),
    # unicode
    ("#### \u0661\u0668", "18"),
    ("#### \uff11\uff18", "18"),
    ("#### \u0967\u096e", "18"),
    ("\u200f#### 18\u200e", "18"),
    ("1\u200b8", "18"),
    ("#### \u00bd", None),
    ("10\u00b2", "10"),
    ("eighteen", None),
    # nothing there, or too big
    ("", None),
    ("no numbers here", None),
    ("1e999999999", None),
    ("9" * (MAX_DIGITS + 1), None),
    ("9" * MAX_DIGITS, "9" * MAX_DIGITS),
    ("9e40", None),
    ("#### " + "9" * 100, None),
]


@pytest.mark.parametrize(("reply", "expected"), HARD)
def test_hard_replies(reply, expected):
    assert extract_answer(reply) == expected


def test_hard_table_is_large():
    assert len(HARD) >= 40


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        ("18.00", "18", True),
        ("0.5", "1/2", True),
        (r"\frac{1}{2}", "0.50", True),
        ("1,000", "1000", True),
        ("#### 1,000", "1000.0", True),
        ("0.333", "1/3", False),
        ("0.1", "1/10", True),
        ("50%", "50", True),
        ("50%", "0.5", False),
        ("-5", "5", False),
        ("", "", False),  # no answer never equals no answer
        ("18", "not a number", False),
    ],
)
def test_math_equal_exact(a, b, equal):
    assert math_equal(a, b) is equal
    assert math_equal(b, a) is equal


def test_canonical_forms():
    assert extract_answer("#### 3/4") == "0.75"
    assert extract_answer("#### 6/8") == "0.75"
    assert extract_answer("#### 2/3") == "2/3"
    assert extract_answer("#### 1234.50") == "1234.5"
    assert extract_answer("#### 1/1099511627776") == "1/1099511627776"  # decimal would be over 40 digits
    assert extract_answer("#### 1e39") == "1" + "0" * 39


def test_non_str_input_is_no_answer():
    for bad in (None, 18, 18.0, b"#### 18", ["#### 18"], object()):
        assert extract_answer(bad) is None
        assert math_equal(bad, "18") is False
        assert math_equal("18", bad) is False
        assert reward(bad, "18") == 0.0


def test_window_reads_the_end_of_a_long_reply():
    assert extract_answer("#### 7\n" + "x " * WINDOW + "#### 18") == "18"
    assert extract_answer("#### 7\n" + "x " * WINDOW) is None  # the marker fell out of the window
    # a number cut by the window edge is not read as its tail
    assert extract_answer("123456" + "x" * (WINDOW - 3)) is None


def test_internal_error_is_warned_and_graded_as_no_answer(monkeypatch):
    def broken(text):
        raise RuntimeError("bug")

    monkeypatch.setattr(grading, "_extract_value", broken)
    with pytest.warns(UserWarning, match="internal error"):
        assert reward("#### 18", "18") == 0.0


# 3. Properties ----------------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(st.text())
def test_no_exception_on_any_text(text):
    value = grading._extract_value(text)  # the unguarded core: a bug raises here
    answer = extract_answer(text)
    assert (value is None) == (answer is None)
    if answer is not None:
        assert Fraction(answer) == value
        assert extract_answer(answer) == answer  # canonical strings are fixed points
        assert math_equal(text, answer)
    assert math_equal(text, text) is (answer is not None)
    assert reward(text, "18") in (0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000))
def test_no_exception_on_random_binary(data):
    text = data.decode("utf-8", errors="replace")
    grading._extract_value(text)
    grading._extract_value(data.decode("latin-1"))
    assert reward(text, "#### 18") in (0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789,.-+/e$#\\{}boxed frac answer is:=\n*", max_size=300))
def test_no_exception_on_number_soup(text):
    grading._extract_value(text)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=-(10**30), max_value=10**30))
def test_integers_round_trip(n):
    assert extract_answer(f"#### {n}") == str(n)
    assert extract_answer(f"#### {n:,}") == str(n)
    assert extract_answer(f"The answer is {n}.") == str(n)
    assert extract_answer(f"\\boxed{{{n}}}") == str(n)
    assert math_equal(f"{n}.00", str(n))
    assert not math_equal(f"#### {n + 1}", str(n))


@settings(max_examples=300, deadline=None)
@given(st.decimals(min_value=-(10**12), max_value=10**12, places=6, allow_nan=False, allow_infinity=False))
def test_decimals_round_trip(d):
    written = format(d, "f")
    answer = extract_answer(f"#### {written}")
    assert answer is not None
    assert Fraction(answer) == Fraction(d)
    assert Decimal(answer) == d  # a decimal's canonical form is a plain decimal
    assert math_equal(written, answer)


@settings(max_examples=300, deadline=None)
@given(st.fractions(min_value=-1000, max_value=1000, max_denominator=10**6))
def test_fractions_round_trip(q):
    answer = extract_answer(f"#### {q.numerator}/{q.denominator}")
    assert answer is not None and Fraction(answer) == q
    assert math_equal(f"\\frac{{{q.numerator}}}{{{q.denominator}}}", answer)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200), st.text(max_size=200))
def test_math_equal_is_symmetric_and_transitive_through_canonical(a, b):
    assert math_equal(a, b) == math_equal(b, a)
    if math_equal(a, b):
        assert extract_answer(a) == extract_answer(b)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=10**9), st.text(alphabet="abc xyz.\n", max_size=50))
def test_marker_beats_any_prose_before_it(n, prose):
    assert extract_answer(f"{prose} 7 {prose}\n#### {n}") == str(n)


# 4. Hostile inputs and the time bound ---------------------------------------------------------------


@pytest.mark.parametrize(("name", "text"), NASTY, ids=[name for name, _ in NASTY])
def test_nasty_input_is_graded_inside_the_time_bound(name, text, faults):
    grading._extract_value(text)  # no exception from the unguarded core
    calls = {
        "extract_answer": lambda: extract_answer(text),
        "math_equal": lambda: math_equal(text, "18"),
        "reward as gold": lambda: reward("#### 18", text),
    }
    for call_name, call in calls.items():
        times = []
        for _ in range(3):  # the best of three: the bound is on the algorithm, not on scheduler jitter
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        assert min(times) < TIME_BOUND_S, f"{name}, {call_name}: {min(times) * 1e3:.1f} ms"
    faults.record("hostile replies", name)


def test_nasty_corpus_expectations():
    answers = {name: extract_answer(text) for name, text in NASTY}
    assert answers["1 MB of prose, answer at the end"] == "18"
    assert answers["power tower"] == "9"  # no arithmetic: the last number
    assert answers["huge exponent"] is None
    assert answers["million-digit number"] is None
    assert answers["million-digit number after a marker"] is None
    assert answers["nested boxes 100000 deep, unclosed"] is None
    assert answers["unclosed box"] == "18"
    assert answers["NUL bytes"] == "18"
    assert answers["RTL marks"] == "18"
    assert answers["Arabic-Indic digits"] == "123456"
    assert answers["unicode minus"] == "-18"
    assert answers["vulgar fraction"] is None


def test_no_code_is_evaluated(tmp_path, faults):
    target = tmp_path / "pwned"
    payloads = [
        f"__import__('os').system('touch {target}')",
        f"#### __import__('os').system('touch {target}')",
        f"\\boxed{{__import__('os').system('touch {target}')}}",
        f"The answer is {{open('{target}', 'w').write('1')}}",
        f"#### {{0.__class__}}{target}",
    ]
    gold = "-987654321.5"  # tmp_path holds digits (pytest-18/...), never this number
    for payload in payloads:
        assert reward(payload, gold) == 0.0
        assert reward(f"#### {gold}", payload) == 0.0
        extract_answer(payload)
    assert not target.exists()
    # a payload that would print 18 is not 18: no number in it counts as evaluated
    assert extract_answer("__import__('os').system('echo $((9*2))')") == "2"
    faults.record("hostile replies", "code in the reply")


def test_module_calls_no_evaluator():
    tree = ast.parse(Path(grading.__file__).read_text(encoding="utf-8"))
    forbidden = {"eval", "exec", "compile", "__import__", "literal_eval", "sympify", "parse_expr"}
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    # re.compile is the one attribute named compile allowed
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} - {"compile"}
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not names & forbidden
    assert not imported & {"sympy", "latex2sympy2", "math_verify", "ast", "subprocess", "os"}
