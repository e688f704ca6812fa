"""sao.tasks.gsm8k.grading: the GSM8K reward. Real gold answers, hard replies, fuzzing, hostile inputs, a time bound."""

from __future__ import annotations

import ast
import json
import re
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from grading_corpus import LABELLED, NASTY
from hypothesis import given, settings
from hypothesis import strategies as st

import sao.tasks.gsm8k.grading as grading
from sao.tasks.gsm8k.grading import MAX_DIGITS, WINDOW, extract_answer, math_equal, reward

GSM8K_TEST = Path(__file__).resolve().parents[2] / "data" / "gsm8k" / "test.jsonl"
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


def test_unmarked_gsm8k_solutions_are_graded_by_their_final_statement():
    # The test split's worked solutions without their #### line and calculator notes (<<9*2=18>>) are real
    # unmarked replies. Reading the last number got 1282 of 1319; the rules for restated numbers, spaced
    # thousands and whole hours get 1307. The rest choose among earlier values or end on a unit conversion.
    rows = []
    with GSM8K_TEST.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                body, gold = json.loads(line)["answer"].rsplit("####", 1)
                rows.append((re.sub(r"<<[^>]*>>", "", body).strip(), gold.strip()))
    assert len(rows) == 1319
    assert sum(reward(body, gold) for body, gold in rows) >= 1300


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
    (r"\boxed{5} was wrong; the answer is 6", "6"),  # a box corrected in prose (rule 14)
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


# 3. The grading rules of the module docstring, one class of replies each ---------------------------
# Each table holds the replies a rule is for and near-misses the rule must leave alone.

# Rule 1: what the window's edge cut is dropped, whatever joined it to the rest of a number.
WINDOW_EDGE = [
    ("1" * 5000 + "/4", None),
    ("1" * 5000 + " / 4", None),
    ("1" * 5000 + ":30", None),
    ("1" * 5000 + " 000", None),
    ("1" * 5000 + ".5e3", None),
    ("\u0661" * 5000 + "/4", None),  # Arabic-Indic digits cut the same way
    ("1" * 5000 + "/4 of them, so 7", "7"),  # the cut number is dropped, not the rest
    ("x" * 5000 + " 3 1/2", "3.5"),  # nothing cut: a number after a space is whole
    ("ab " * 3000 + "#### 18", "18"),
    ("lorem " * 1000 + "\n12 345", "12345"),
]


@pytest.mark.parametrize(("reply", "expected"), WINDOW_EDGE, ids=range(len(WINDOW_EDGE)))
def test_a_number_cut_at_the_window_edge_is_dropped(reply, expected):
    assert len(reply) > WINDOW
    assert extract_answer(reply) == expected


# Rule 3: alternatives side by side are a hedge; work between boxes is a revision; the same value twice is fine.
HEDGES = [
    (r"\boxed{18} or \boxed{20}", None),
    (r"The answer is $\boxed{20}$ or $\boxed{18}$.", None),
    ("**Final Answer**\n\\boxed{16}\n\n**Alternative Answer**\n\\boxed{18}", None),
    (r"\boxed{18}, \boxed{20}", None),
    (r"\boxed{18 \text{ or } 20}", None),
    ("The answer is 18 or 20.", None),
    ("#### 18 or 20", None),
    ("The answer is 18, or 1:30", None),  # a clock is a different (invalid) value
    # near-misses
    (r"\boxed{18} or \boxed{18.00}", "18"),
    (r"\boxed{18} (that is, \boxed{\$18})", "18"),
    ("\\boxed{26}\n\nWait: 16 - 3 - 4 = 9 and 9 * 2 = 18.\n\\boxed{18}", "18"),
    ("Step 1: \\boxed{9}\nStep 2: 9 * 2 = \\boxed{18}", "18"),
    (r"\boxed{\boxed{7}}", "7"),
    (r"\boxed{x} or \boxed{18}", "18"),  # a box holding no number is not an answer to hedge with
    ("The answer is 18 (or $18.00).", "18"),
    ("The answer is 18 dollars, or 1800 cents.", "18"),
    ("The answer is 18, or so it seems.", "18"),
    ("So she makes either 18 or 20 dollars.", "20"),  # "or" in working is not read as a hedge ...
    ("She saved 210 / 350 = 0.60 or 60% off.", "60"),  # ... because there it mostly restates a value
    ("#### 12\n\\boxed{13}", "13"),  # a box after a #### line is a later marker, not a hedge
]


@pytest.mark.parametrize(("reply", "expected"), HEDGES, ids=range(len(HEDGES)))
def test_a_hedge_between_two_values_has_no_answer(reply, expected):
    assert extract_answer(reply) == expected


# Rule 4: a conditional phrase does not override an assertive one.
HYPOTHETICALS = [
    ("The answer is 18. If she sold all 16 eggs, the answer would be 32.", "18"),
    ("Answer: 18. Had she eaten none, the answer could be 24.", "18"),
    ("The answer was 5; with one more friend the answer might be 4.", "5"),
    ("**Answer:** 7\n\n(If it meant weeks, the answer would have been 49.)", "7"),
    ("The final answer should be 18, though the answer would be 20 with tax.", "18"),
    # near-misses
    ("The answer would be 12 apples.", "12"),
    ("If she sold 16, the answer would be 32. But she eats 7, so the answer is 18.", "18"),
    ("The answer could be 4 or 5.", None),  # a conditional alone still counts, and this one hedges
    ("The answer is 3. Rechecking, the answer is 4.", "4"),
]


@pytest.mark.parametrize(("reply", "expected"), HYPOTHETICALS, ids=range(len(HYPOTHETICALS)))
def test_a_hypothetical_after_the_answer_does_not_replace_it(reply, expected):
    assert extract_answer(reply) == expected


# Rules 5 and 6: a reply or a marker that ends in an unfinished calculation was cut off.
UNFINISHED = [
    ("Each person pays 180/5 =", None),
    ("The total is 12 + 15 +", None),
    ("She has 20 - 5 = 15 left, and 15 * 3 =", None),
    (r"The area is $12 \times 3 =$", None),
    ("The cost is 4 * $5 = $", None),
    ("The answer is 180 / 5 =", None),
    ("#### 9 * 2 =", None),
    (r"\boxed{180/5 =}", None),
    ("Total =", None),
    # near-misses
    ("Each person pays 180/5 = 36.", "36"),
    ("So 9 * 2 = 18 dollars.\n\n---", "18"),
    ("9 * 2 = 18\n", "18"),
    ("The answer is 36. Check: 180 / 5 =", "36"),
    ("\\boxed{36}\n\nCheck: 36 * 5 =", "36"),
    ("Profit: 18%", "18"),
    ("The total is 18 ===", "18"),  # a rule of = signs, not an equation
]


@pytest.mark.parametrize(("reply", "expected"), UNFINISHED, ids=range(len(UNFINISHED)))
def test_a_reply_cut_off_mid_calculation_has_no_answer(reply, expected):
    assert extract_answer(reply) == expected


# Rule 5: numbers after an unmarked answer that only repeat earlier ones restate the question.
RESTATED = [
    ("16 - 3 - 4 = 9 eggs. 9 * 2 = 18. Therefore, Janet makes $18 every day by selling 9 duck eggs at $2 each.", "18"),
    ("He runs 3 * 3 = 9 sprints, 9 * 60 = 540 meters. So 540 meters: 3 sprints, 3 times, 60 meters each.", "540"),
    ("The white fiber is 2 / 2 = 1 bolt, so 2 + 1 = 3 bolts (2 blue and 1 white).", "3"),
    ("Therefore 9 * 2 = 18 dollars, from the 16 eggs minus 3 minus 4 = 9.", "9"),  # the last equation counts
    ("So 10 - 4 = 6 remain, out of 10, after 4 were sold.", "6"),
    # near-misses: a new number after the result is a new result; a final sentence without it chose another
    ("3 * 50 = 150. 2 * 50 + 5 * 30 = 250. 50 + 2 * 40 = 130.\nSo the most he can earn is $250.", "250"),
    ("20 - 5 = 15 apples.\n\nQuestion: Sara had 20 apples and gave away 5.", "5"),
    ("3 + 4 = 7 cats. She adopts 7 more, so she has 14 cats.", "14"),
    ("4 * 5 = 20 cookies. She eats 3, so 17 are left.", "17"),
    ("Each box holds 6 * 2 = 12 eggs and there are 12 boxes, so 144 eggs.", "144"),
    ("She has 3 cats and 4 dogs, so 7 pets.", "7"),  # no equation: the last number
    ("5 * 3 = 15. 15 + 5 = 20.", "20"),
    ("1 + 1 = 2 and then 2 2 2", "2"),
    ("2 + 3 = 5, then " + "2 3 " * 8, "5"),  # 16 repeats after the result: still a restatement
    ("2 + 3 = 5, then " + "2 3 " * 9, "3"),  # 18 are more work, not a restatement: the last number
]


@pytest.mark.parametrize(("reply", "expected"), RESTATED, ids=range(len(RESTATED)))
def test_numbers_restated_after_an_unmarked_answer_are_not_the_answer(reply, expected):
    assert extract_answer(reply) == expected


# Rule 6: a marker that opens with an expression is graded by its result.
RESULTS = [
    ("The answer is 1/2 of 36, which is 18.", "18"),
    ("The answer is 50% of 36, which is 18 students.", "18"),
    ("#### 3 times 6 is 18", "18"),
    ("The answer is 9 * 2, which equals 18.", "18"),
    (r"\boxed{5 \text{ apples} + 13 \text{ apples} = 18 \text{ apples}}", "18"),
    ("The answer is 2(9) = 18", "18"),
    ("The answer is 36 divided by 2, which gives 18.", "18"),
    (r"\boxed{3 \cdot 6 = 18}", "18"),
    # near-misses: a marker that opens with its answer keeps it
    ("The answer is 18, which is 9 times 2.", "18"),
    (r"\boxed{18 = 9 \times 2}", "18"),
    ("The answer is 18 dollars, which is 2 more than 16.", "18"),
    ("The answer is 5 if she has 3 eggs.", "5"),
    ("The answer is 1/2.", "0.5"),
    (r"\boxed{9 \times 2}", "9"),  # no result written: no arithmetic is done
    ("#### 18 eggs - she sells them all", "18"),
]


@pytest.mark.parametrize(("reply", "expected"), RESULTS, ids=range(len(RESULTS)))
def test_a_marker_that_opens_with_an_expression_is_graded_by_its_result(reply, expected):
    assert extract_answer(reply) == expected


# Rule 8: a space before exactly three digits separates thousands.
THOUSANDS = [
    ("The total is 1 000 dollars.", "1000"),
    ("#### 12 345 678", "12345678"),
    ("The answer is 2 500.50", "2500.5"),
    ("1\u202f000", "1000"),  # narrow no-break space
    ("1\u00a0000", "1000"),  # no-break space
    ("1\u2009000", "1000"),  # thin space
    (r"\boxed{1\,000}", "1000"),
    ("-1 000", "-1000"),
    # near-misses
    ("She pays with 5 100-dollar bills", "100"),
    ("1 2", "2"),
    ("12 34", "34"),
    ("1 0000", "0"),
    ("1  000", "0"),  # two spaces separate
    ("In 2023 100 people came.", "100"),
    ("1, 2, 3", "3"),
    ("The times were 1:00 000", "0"),
]


@pytest.mark.parametrize(("reply", "expected"), THOUSANDS, ids=range(len(THOUSANDS)))
def test_a_space_separates_thousands_before_three_digits(reply, expected):
    assert extract_answer(reply) == expected


# Rule 9: an integer, a space and a proper fraction are one mixed number.
MIXED = [
    ("She needs 3 1/2 cups.", "3.5"),
    ("#### 2 3/4", "2.75"),
    ("The answer is -1 1/4", "-1.25"),
    (r"\boxed{2\frac{1}{2}}", "2.5"),
    (r"\boxed{2 \frac{1}{2}}", "2.5"),
    (r"$2\tfrac12$ miles", "2.5"),
    ("It weighs 10 7/8 pounds.", "10.875"),
    ("She ran 3 5/4 miles", None),  # an improper fraction there is not a number anyone writes
    # near-misses
    ("3 / 4", "0.75"),
    ("Each gets 3/4 of a pizza.", "0.75"),
    ("He has 7, 1/2 of them red", "0.5"),
    ("1 0/4", "0"),
]


@pytest.mark.parametrize(("reply", "expected"), MIXED, ids=range(len(MIXED)))
def test_an_integer_and_a_proper_fraction_are_a_mixed_number(reply, expected):
    assert extract_answer(reply) == expected


# Rule 10: colon-joined digits are one token; only a whole hour has a value.
CLOCKS = [
    ("It takes 1:30.", None),
    ("#### 1:30", None),
    (r"\boxed{12:45}", None),
    ("The answer is 1:30 hours.", None),
    ("The ratio is 3:2", None),
    ("She arrives at 10:15:00", None),
    ("She will eat dinner at 7:00 pm.", "7"),
    ("#### 2:00", "2"),
    ("The answer is 12:00", "12"),
    # near-misses
    ("answer: 90", "90"),
    ("Step 1: 30 minutes", "30"),
    ("At 1:30 she left; she walked 45 minutes.", "45"),
    ("The ratio is 3 : 2", "2"),
    ("Time: 90", "90"),
]


@pytest.mark.parametrize(("reply", "expected"), CLOCKS, ids=range(len(CLOCKS)))
def test_a_clock_time_is_not_a_number_unless_a_whole_hour(reply, expected):
    assert extract_answer(reply) == expected


# Rule 11: number words count inside a box or an answer phrase, nowhere else.
WORDS = [
    ("The answer is eighteen.", "18"),
    ("The answer is Eighteen dollars.", "18"),
    ("Answer: one hundred and five", "105"),
    (r"\boxed{\text{twenty-five}}", "25"),
    ("The final answer is twelve hundred.", "1200"),
    ("The answer is two million three hundred thousand", "2300000"),
    ("The answer is zero.", "0"),
    ("The answer is nine times two, which is eighteen.", "18"),
    ("The answer is one thousand and one", "1001"),
    # near-misses
    ("The answer is one of the two options: 5", "5"),
    ("She has eighteen eggs and 3 baskets.", "3"),  # outside a marker words are not read
    ("So she has eighteen eggs.", None),
    ("#### eighteen", None),  # a #### line must open with digits
    ("The answer is one two three", None),  # ill-formed: left as words
    ("The answer is twofold: 5", "5"),
    ("The answer is ten-fold", None),
    ("The answer is someone's 5", "5"),
    ("The answer is a hundred", None),
]


@pytest.mark.parametrize(("reply", "expected"), WORDS, ids=range(len(WORDS)))
def test_number_words_count_only_inside_a_marker(reply, expected):
    assert extract_answer(reply) == expected


@pytest.mark.parametrize(
    ("words", "value"),
    [
        ("zero", 0),
        ("nineteen", 19),
        ("twenty-one", 21),
        ("ninety nine", 99),
        ("one hundred", 100),
        ("one hundred and five", 105),
        ("twenty-five hundred", 2500),
        ("one thousand two hundred thirty-four", 1234),
        ("three million and seven", 3000007),
        ("one two", None),
        ("twenty fifteen", None),
        ("hundred", None),
        ("one hundred hundred", None),
        ("one thousand one million", None),
        ("zero zero", None),
        ("one and", None),
        ("and one", None),
    ],
)
def test_number_word_grammar(words, value):
    assert grading._words_value(words) == value


# Rule 12: spaces of any kind are spaces, invisible characters are dropped.
INVISIBLE = [
    ("1\u200b8", "18"),
    ("1\x008", "18"),
    ("#### \ue00018", "18"),
    ("1\ud8008", "18"),
    ("The answer\u00a0is 18.", "18"),
    ("#### \u0661\u0668", "18"),
    ("1\u20288", "8"),  # a line separator is a space
]


@pytest.mark.parametrize(("reply", "expected"), INVISIBLE, ids=range(len(INVISIBLE)))
def test_invisible_characters_are_dropped_and_spaces_kept(reply, expected):
    assert extract_answer(reply) == expected


# Rule 13: after the restated result, numbers that restate the question's data ("for 16 glasses at $5") are data.
RESTATED_DATA = [
    ("So 24 + 40 = $64 in total for 16 glasses at $5 and 60% of $5.", "64"),
    ("She sells 9 * 2 = 18 dollars of eggs, so she makes $18 a day from 16 eggs at $2 each.", "18"),
    ("He runs 9 * 60 = 540 meters, so 540 meters in total for 3 sprints of 60 meters.", "540"),
    ("Each pays 180 / 5 = 36, so 36 dollars each out of the 180 dollar bill.", "36"),
    ("She needs 3 * 20 = 60 cups, so 60 cups a day for 20 chickens with 3 cups each.", "60"),
    ("The total is 5 + 7 = 12 apples, 12 apples between 2 friends and 1 teacher.", "12"),
    # near-misses: a number that is not introduced as data is a new result, and data come only after the result
    ("3 + 4 = 7 cats. She adopts 7 more, so she has 14 cats.", "14"),
    ("Each box holds 6 * 2 = 12 eggs, so 3 boxes hold 36 eggs.", "36"),
    ("So 24 + 40 = $64 in total, and she pays 10 more.", "10"),
    ("So 2 + 3 = 5 for now, and 8 later.", "8"),
    ("He pays 8 * 3 = $24 and then 24 + 40 = $64 in total, leaving 70 dollars.", "70"),
]


@pytest.mark.parametrize(("reply", "expected"), RESTATED_DATA, ids=range(len(RESTATED_DATA)))
def test_the_questions_data_restated_after_the_answer_are_not_the_answer(reply, expected):
    assert extract_answer(reply) == expected


# Rule 14: prose after a marker or a phrase that admits a mistake and works to another number revises it.
CORRECTIONS = [
    ("\\boxed{26}\n\nWait, she eats 3 and bakes 4, so she sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 = 18.", "18"),
    ("#### 26\n\nActually, I made a mistake: 9 * 2 = 18 dollars.", "18"),
    ("\\boxed{5} was wrong; the answer is 6", "6"),
    ("The answer is 26.\n\nOops, I forgot the muffins: 16 - 3 - 4 = 9, so she makes $18.", "18"),
    ("The answer is 40. Correction: the total is 24 + 40 = 64.", "64"),
    ("\\boxed{30}\nI miscalculated above. 180 / 5 = 36.", "36"),
    ("Answer: 12. Let me recalculate: 4 * 4 = 16.", "16"),
    ("\\boxed{7} Wait, that's incorrect, she has 8.", "8"),
    # near-misses: a check that agrees, a hypothetical, prose that restates but works nothing, no cue at all
    ("\\boxed{18}\n\nWait, let me double-check: 9 * 2 = 18. Yes.", "18"),
    ("\\boxed{18}\n\nWait, if she also sold the muffin eggs, it would be 26.", "18"),
    ("\\boxed{18}\n\nActually, she sells 9 eggs at $2 each.", "18"),
    ("\\boxed{36}\n\nCheck: 36 * 5 = 180.", "36"),
    ("The answer is 36. Let me double-check: 180 / 5 =", "36"),
    ("#### 18\nNo mistakes here.", "18"),
    ("The answer is 18. Actually, the answer would be 20 with tax.", "18"),
]


@pytest.mark.parametrize(("reply", "expected"), CORRECTIONS, ids=range(len(CORRECTIONS)))
def test_a_marked_answer_corrected_later_in_prose_is_revised(reply, expected):
    assert extract_answer(reply) == expected


# Rule 15: a value the reply rejects is never its answer.
REJECTED = [
    ("So she makes $12, not $18.", "12"),
    ("She has 16 - 3 - 4 = 9 eggs, so 9 * 2 = 18 dollars instead of 26.", "18"),
    ("The total is 64 rather than 48.", "64"),
    ("That gives 7 cats and not 14.", "7"),
    ("He earns 250 dollars, isn't 130.", "250"),
    ("So it is 36 (not 30).", "36"),
    ("She did not buy 5; she bought 7.", "7"),
    # near-misses: "not" that rejects nothing numeric, a later number after the rejected one
    ("She makes $18, not counting the 3 she eats.", "3"),
    ("Not 18 but 20.", "20"),
    ("It is more than 5 and less than 7, so 6.", "6"),
    ("Nothing is left: 0.", "0"),
]


@pytest.mark.parametrize(("reply", "expected"), REJECTED, ids=range(len(REJECTED)))
def test_a_value_the_reply_rejects_is_not_its_answer(reply, expected):
    assert extract_answer(reply) == expected


# Rule 16: a rate converted to another period in an aside after it leaves the rate the answer.
RATES = [
    ("She sells 9 eggs at $2, so 9 * 2 = 18 dollars a day, which is 126 dollars a week.", "18"),
    ("So he earns $15 per hour (that's $600 per week).", "15"),
    ("She reads 20 pages a day, or 140 pages a week.", "20"),
    ("9 * 2 = 18 dollars per day. That is 126 dollars per week.", "18"),
    ("He saves $50 each month, i.e. $600 a year.", "50"),
    ("It makes 4 liters daily, which is 28 liters weekly.", "4"),
    ("The pump moves 3 gallons per minute; that is 180 gallons per hour.", "3"),
    ("So she drives 40 miles a day, that is about 280 miles a week.", "40"),
    # near-misses: a conversion that is the conclusion, the same period, a rate not followed by an aside
    ("She makes 18 dollars a day, so 18 * 7 = 126 dollars a week.", "126"),
    ("He earns 15 dollars per hour, so 600 dollars per week.", "600"),
    ("It costs 5 dollars a day, which is 5 dollars a day more than before.", "5"),
    ("She reads 20 pages a day and 10 pages a night.", "10"),
    ("He works 8 hours a day, which is 40 hours.", "40"),
]


@pytest.mark.parametrize(("reply", "expected"), RATES, ids=range(len(RATES)))
def test_a_rate_converted_in_an_aside_leaves_the_rate_the_answer(reply, expected):
    assert extract_answer(reply) == expected


# Rule 17: a number written with a scale word is that number times the scale, wherever it stands.
SCALED = [
    ("The city has 2.5 million people.", "2500000"),
    ("#### 1.2 billion", "1200000000"),
    ("The answer is 3 thousand dollars.", "3000"),
    (r"\boxed{4.75 million}", "4750000"),
    ("It costs $1,500 million.", "1500000000"),
    ("She raised 0.5 Million dollars", "500000"),
    ("The answer is 2.5 million.", "2500000"),
    ("The prize is 1.2345 thousand", "1234.5"),
    # near-misses: words alone outside markers, a hyphenated scale, a scale with no number
    ("A million people came, 3 stayed.", "3"),
    ("She bought 5 million-dollar homes.", "5"),
    ("Thousands came: 40.", "40"),
    ("The answer is two million.", "2000000"),  # number words inside a phrase (rule 11), unchanged
]


@pytest.mark.parametrize(("reply", "expected"), SCALED, ids=range(len(SCALED)))
def test_a_number_with_a_scale_word_is_scaled(reply, expected):
    assert extract_answer(reply) == expected


def test_rule_tables_hold_several_cases_and_near_misses():
    tables = [
        WINDOW_EDGE,
        HEDGES,
        HYPOTHETICALS,
        UNFINISHED,
        RESTATED,
        RESULTS,
        THOUSANDS,
        MIXED,
        CLOCKS,
        WORDS,
        RESTATED_DATA,
        CORRECTIONS,
        REJECTED,
        RATES,
        SCALED,
    ]
    for table in tables:
        assert len(table) >= 8
        assert len({expected for _, expected in table}) >= 2  # replies the rule changes and ones it leaves


# Replies labelled by hand (tests/tasks/grading_corpus.py): the grader must agree on all but the known misses,
# each a case the rules decide on purpose or cannot see.
KNOWN_MISSES = {
    "20 - 5 = 15 apples.": "a restatement in a later sentence (an echoed question) is taken for a choice",
    "So she makes either 18 or 20": "'or' between numbers in working is not a hedge (it mostly restates a value)",
    "She walks for 45 + 45": "a clock time is ambiguous without the question (rule 10), even after '90 minutes'",
    "The answer is 1:30.": "a clock time is ambiguous without the question (rule 10)",
    "#### 1:30": "a clock time is ambiguous without the question (rule 10)",
    "So in total she has eighteen eggs.": "number words outside a marker are not read (rule 11)",
    "The answer is \\boxed{9 \\times 2}.": "no arithmetic: an expression without its result is its first number",
}


def _known_miss(reply: str) -> str | None:
    return next((why for start, why in KNOWN_MISSES.items() if reply.startswith(start)), None)


@pytest.mark.parametrize(
    ("kind", "reply", "gold", "correct"), LABELLED, ids=[f"{kind}-{i}" for i, (kind, *_) in enumerate(LABELLED)]
)
def test_labelled_replies_agree_with_the_hand_label(kind, reply, gold, correct):
    agrees = (reward(reply, gold) == 1.0) == correct
    assert agrees is (_known_miss(reply) is None), (kind, reply, gold, correct, extract_answer(reply))


def test_labelled_corpus_covers_every_rule_kind():
    kinds = {kind for kind, *_ in LABELLED}
    assert {"plain", "restated", "hedge", "truncated", "clock", "thousands", "words", "hypothetical"} <= kinds
    assert {"mixed", "expression"} <= kinds
    assert len(LABELLED) >= 80
    # every known miss names a labelled reply, so the list cannot go stale silently
    assert all(any(reply.startswith(start) for _, reply, _, _ in LABELLED) for start in KNOWN_MISSES)


# 4. Properties ----------------------------------------------------------------------------------------


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


_ONES = [
    *("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"),
    *("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"),
]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def _spell(n: int, use_and: bool) -> str:
    """English words for 0 <= n < 10**12, written independently of the grader's parser."""
    if n == 0:
        return "zero"
    parts = []
    for scale, name in ((10**9, "billion"), (10**6, "million"), (10**3, "thousand"), (1, "")):
        group, n = divmod(n, scale)
        if not group:
            continue
        words = []
        if group >= 100:
            words += [_ONES[group // 100], "hundred"]
            if group % 100 and use_and:
                words.append("and")
        rest = group % 100
        if rest:
            words.append(
                _ONES[rest] if rest < 20 else _TENS[rest // 10] + (f"-{_ONES[rest % 10]}" if rest % 10 else "")
            )
        parts.append(" ".join(words) + (f" {name}" if name else ""))
    return " ".join(parts)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=10**12 - 1), st.booleans())
def test_number_words_round_trip(n, use_and):
    words = _spell(n, use_and)
    assert extract_answer(f"The answer is {words}.") == str(n)
    assert extract_answer(f"\\boxed{{\\text{{{words.capitalize()}}}}}") == str(n)
    assert extract_answer(f"The answer is {words} of them; 7") == "7"  # a run followed by "of" is not a number


@settings(max_examples=300, deadline=None)
@given(
    st.integers(min_value=0, max_value=10**6),
    st.integers(min_value=2, max_value=1000).flatmap(lambda d: st.tuples(st.integers(1, d - 1), st.just(d))),
)
def test_mixed_numbers_round_trip(whole, fraction):
    numerator, denominator = fraction
    value = whole + Fraction(numerator, denominator)
    assert Fraction(extract_answer(f"She needs {whole} {numerator}/{denominator} cups.")) == value
    assert Fraction(extract_answer(f"\\boxed{{{whole}\\frac{{{numerator}}}{{{denominator}}}}}")) == value
    assert Fraction(extract_answer(f"#### -{whole} {numerator}/{denominator}")) == -value


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=-(10**30), max_value=10**30), st.sampled_from([" ", "\u00a0", "\u202f", "\u2009"]))
def test_space_grouped_integers_round_trip(n, space):
    written = f"{n:,}".replace(",", space)
    assert extract_answer(f"The total is {written} dollars.") == str(n)
    assert extract_answer(f"#### {written}") == str(n)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-1000, max_value=1000), st.integers(min_value=-1000, max_value=1000))
def test_boxes_side_by_side_hedge_unless_equal(a, b):
    answer = extract_answer(f"The answer is \\boxed{{{a}}} or \\boxed{{{b}}}.")
    assert answer == (str(a) if a == b else None)
    # work between them makes the later box a revision
    assert extract_answer(f"\\boxed{{{a}}}\nRechecking: 2 + 3 = 5.\n\\boxed{{{b}}}") == str(b)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=23), st.integers(min_value=0, max_value=59))
def test_clock_times_are_whole_hours_or_nothing(hour, minute):
    expected = str(hour) if minute == 0 else None
    assert extract_answer(f"She arrives at {hour}:{minute:02d}.") == expected
    assert extract_answer(f"#### {hour}:{minute:02d}") == expected


# 5. Hostile inputs and the time bound ---------------------------------------------------------------


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
    # the inputs aimed at the newer rules
    assert answers["clock soup after a marker"] is None
    assert answers["space-grouped soup"] is None  # one grouped number of 3001 digits: invalid
    assert answers["mixed-number soup"] == "1.5"
    assert answers["number words in phrases"] == "21"
    assert answers["number words in a box"] is None  # an ill-formed run stays words
    assert answers["number-word run then of"] is None
    assert answers["hedged boxes"] is None
    assert answers["or soup"] == "2"  # "or" in working is not a hedge
    assert answers["or soup in a box"] is None
    assert answers["equals soup"] == "2"
    assert answers["restated numbers"] == "2"
    assert answers["operator tail"] is None
    assert answers["conditional phrases"] == "7"
    assert answers["phrases with LaTeX and no number"] is None
    assert answers["#### lines with LaTeX and no number"] is None
    assert answers["operand then many equals"] == "18"
    assert answers["operand chain in a box"] == "1"  # the first number after the last equals
    assert answers["spaces after a #### in the window"] is None
    assert answers["spaces inside a box opening"] == "18"
    assert answers["spaces inside a cut number"] is None
    assert answers["spaces after a phrase in the window"] is None
    assert answers["stars after a phrase in the window"] is None
    assert answers["dollars after a phrase"] is None
    assert answers["spaces after a number word"] == "1"
    assert answers["spaces after an operand in a box"] == "18"
    assert answers["spaces before or in a box"] is None  # 18 or 20: a hedge


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
