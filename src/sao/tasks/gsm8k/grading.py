r"""Grade a model's reply against a GSM8K gold answer: exact, bounded in time, never executing anything.

The SAO reward of the protocol is 1 if the final answer of a reply equals the GSM8K gold numerically, else 0:
``reward(completion, gold)`` wraps ``math_equal``, which compares what ``extract_answer`` finds in both strings as
exact ``fractions.Fraction`` values. The final answer is what a careful human grader would decide from the reply
alone: the last marker (``#### N``, ``\boxed{}``), else the last assertive answer phrase, else the last number, with
rules for hedges, expressions, thousands, mixed numbers, clock times, number words and Unicode; a reply that does
not commit to one value has no answer. Rules 13-17 settle realistic endings: the question's data restated after
the answer ("... $64 in total for 16 glasses at $5") are not the answer; prose after a marker or phrase that
admits a mistake and works to a number revises it; a rejected value ("12, not 18") is never the answer; a rate
converted in an aside ("18 a day, which is 126 a week") leaves the rate; "2.5 million" is 2500000.
``extract_answer`` returns one canonical string per rational. Time is bounded by construction: well under 50 ms
per call for any ``str`` (a 4096-character window, capped scans).

Deliberately left out: ``eval``/``exec``/sympy, arithmetic, unit or percent conversion, tolerance, decimal commas,
the question, and judging the reasoning. Non-``str`` input gives None / False / 0.0, and an internal error is warned
about and counted as no answer. Design notes: docs/design/grading.md (the seventeen rules, the time bound).
"""

from __future__ import annotations

import re
import unicodedata
import warnings
from bisect import bisect_left
from fractions import Fraction
from itertools import filterfalse
from operator import itemgetter

__all__ = ["MAX_DIGITS", "WINDOW", "extract_answer", "math_equal", "reward"]

WINDOW = 4096
MAX_DIGITS = 40
_SEGMENT_CHARS = 200  # how far past a #### or "answer is" marker the answer may run
_MAX_EXPONENT = 40

# Non-ASCII characters that are not decimal digits but have an ASCII meaning here.
_UNICODE_PUNCT = {
    "\u2212": "-",  # minus sign
    "\ufe63": "-",  # small hyphen-minus
    "\uff0d": "-",  # fullwidth hyphen-minus
    "\uff0b": "+",
    "\uff04": "$",
    "\uff0c": ",",
    "\uff0e": ".",
    "\uff05": "%",
    "\uff0f": "/",
    "\u2044": "/",  # fraction slash
    "\u066b": ".",  # Arabic decimal separator
    "\u066c": ",",  # Arabic thousands separator
    "\uff1d": "=",
}
# Characters kept as they are: printable ASCII and the three whitespace controls every reply has.
_PLAIN_ASCII = frozenset(map(chr, range(0x20, 0x7F))) | {"\t", "\n", "\r"}
# ASCII controls: other whitespace becomes a space, the rest is invisible and dropped (rule 12).
_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_ASCII_TABLE = {c: (" " if chr(c).isspace() else None) for c in range(0x80) if chr(c) not in _PLAIN_ASCII}

_NUMBER = re.compile(
    r"""
    (?=[-+]?[$€£]?\.?[0-9])                 # a cheap first test: most positions fail here
    (?<![A-Za-z0-9_.])(?<![0-9]:)           # not glued to a word, a number, a dot or a clock's colon
    (?P<sign>[-+])?
    [$€£]?
    (?:
        (?P<clock>[0-9]+(?::[0-9]+)+)       # 1:30, 3:2: one token, valid only as a whole hour (rule 10)
      | (?P<whole>[0-9]+)[ ](?P<mnum>[1-9][0-9]*)/(?P<mden>[0-9]+)(?![0-9:/]|\.[0-9])   # 3 1/2 (rule 9)
      | (?:
            (?P<int>
                [0-9]{1,3}(?:,[0-9]{3})+(?![0-9])           # 1,234
              | [0-9]{1,3}(?:[ ][0-9]{3})+(?![0-9:/-])      # 1 000 (rule 8)
              | [0-9]+
            )
            (?:\.(?P<dec>[0-9]+))?
          | \.(?P<dec0>[0-9]+)
        )
        (?:[eE](?P<exp>[-+]?[0-9]+))?
        (?:[ \t]*+/[ \t]*+(?P<den>[0-9]+)(?!\.[0-9]))?
    )
    """,
    re.VERBOSE,
)
# What may be the tail of a number or word cut at the window's edge (rule 1), read on the raw window.
# A cut word ends at a space; a cut number may go on past one where rules 7-9 join ("1 000", "3 1/2", "3 / 4").
_CUT_TAIL = re.compile(r"[^\W\d][\w.,]*|(?:[\w.,:+\-]|[^\S\n]*+/[^\S\n]*+|[^\S\n](?=\d{3}(?!\d)|\d+/))*")
_MAX_CANDIDATES = 64  # markers of one kind examined, from the last: a time bound, no reply has more
_MAX_RESTATED = 16  # numbers that may follow an unmarked result and still be a restatement (rule 5)
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)[ \t]*+\{")
_BRACE = re.compile(r"[{}]")
_ANSWER_PHRASE = re.compile(
    r"(?=[aA])\banswer\b[ \t*_]*+"
    r"(?:(?:is|was|(?:will|should)[ \t]+be|(?P<conditional>(?:would|could|might)[ \t]+(?:have[ \t]+been|be)))"
    r"\b[ \t*_]*+[:=]?|[:=])",
    re.IGNORECASE,
)
_SENTENCE_END = re.compile(r"[\n;!?]|\.(?=\s|$)")
_LEADING_MARKUP = re.compile(r"[ \t*_:$€£({\[]*")
# A number followed by one of these is an operand of an expression, not a result (rule 6).
_OPERATOR_AFTER = re.compile(
    r"\((?=[0-9])|[ \t{}]*+%?[ \t{}]*+(?:[A-Za-z]++[ \t{}]*+)??"
    r"(?:[-+*/×÷^·]|x(?=[ \t]*[0-9])|(?:of|times|plus|minus|divided|multiplied)\b)",
    re.IGNORECASE,
)
_EQUALS = re.compile(r"(?=[=iawegmc])(?:=|\b(?:is|are|was|equals?|gives|makes|comes[ \t]+to)\b)", re.IGNORECASE)
_OR_JOIN = re.compile(r"[\s{}$*,(]*+\bor\b[\s{}$*(]*+", re.IGNORECASE)  # what joins two hedged numbers
_OPERATOR_CHARS = "=+-*/×÷^·"
_TRAILING_MARKUP = " \t\r\n$*`_\\])}"
_KEY_DROP = str.maketrans("", "", "$€£, +")
# LaTeX clean-up, applied in this order.
_LATEX_SPACING = re.compile(r"\\[,!;: ]|\{,\}")
_LATEX_ESCAPED = re.compile(r"\\([$%])")
_LATEX_FRAC = re.compile(
    r"\\[dt]?frac[ \t]*(?:\{[ \t]*([-+]?[0-9.,]+)[ \t]*\}[ \t]*\{[ \t]*([0-9]+)[ \t]*\}|([0-9])([0-9]))"
)
_LATEX_OPERATORS = {"times": " × ", "cdot": " · ", "div": " ÷ "}
_LATEX_OPERATOR = re.compile(r"\\(times|cdot|div)(?![A-Za-z])")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")

# Rules 13-17: restated data, corrections, rejected values, converted rates, scaled numbers.
_DATA_BEFORE = re.compile(
    r"\b(?P<word>for|at|of|from|with|by|per|each|among|between|out[ \t]+of|and)"
    r"(?:[ \t]+(?:the|a|an|her|his|their|its))?[ \t$€£(]*+$",
    re.IGNORECASE,
)  # the word before a number that restates the question's data after the result
_CORRECTION = re.compile(
    r"\b(?:wait|actually|oops|correction|mistakes?|errors?|wrong|incorrect|miscalculat\w*|recalculat\w*|"
    r"recomput\w*|redo(?:ing)?|re-?do)\b",
    re.IGNORECASE,
)
_CONCLUDES = re.compile(
    r"=|\b(?:is|are|was|were|equals?|gives|makes|comes[ \t]+to|ha[sd]|have|gets|got|needs|costs|earns|pays|"
    r"totals?|so|therefore|thus)\b",
    re.IGNORECASE,
)  # what a sentence that works to a number says
_HYPOTHETICAL = re.compile(r"\b(?:if|would|could|might|suppose|assuming)\b", re.IGNORECASE)
_REJECTED_BEFORE = re.compile(r"(?:\bnot|n't|\binstead[ \t]+of|\brather[ \t]+than)[ \t$€£(]*+$", re.IGNORECASE)
_PERIOD = r"(?:second|minute|hour|day|night|week|weekend|month|year|shift|session|lesson|semester|quarter)s?"
_PER_PERIOD = (
    rf"(?:(?:per|a|an|each|every|in[ \t]+a|in[ \t]+one)[ \t]+(?P<{{name}}>{_PERIOD})\b"
    r"|(?P<{adj}>(?:dai|hour|week|month|year)ly)\b)"
)
# "... 18 dollars a day, which is 126 dollars a week": an aside converting the rate just stated (rule 16)
_ASIDE = r"(?:which[ \t]+is|which[ \t]+comes[ \t]+to|that[ \t]+is|that's|i\.e\.,?|or)[ \t]+"
_RATE_ASIDE = re.compile(
    r"[ \t]*+(?:[A-Za-z]+[ \t]+){0,2}?"
    + _PER_PERIOD.format(name="first", adj="first_adj")
    + rf"(?:[ \t]*+[,;(][ \t]*+(?:{_ASIDE})?|[ \t]++{_ASIDE}|\.[ \t]++(?:that[ \t]+is|that's|this[ \t]+is)[ \t]++)"
    r"(?:about[ \t]+|roughly[ \t]+)?$",
    re.IGNORECASE,
)
_RATE_AFTER = re.compile(
    r"[ \t]*+(?:[A-Za-z]+[ \t]+){0,2}?" + _PER_PERIOD.format(name="second", adj="second_adj"), re.IGNORECASE
)
_OPERATORS_ONLY = re.compile(r"[ \t]*+[-+*/×x·÷=][-+*/×x·÷= \t]*+")  # "18 * 7 = 126": one expression
_SCALE_WORD = re.compile(r"(?=[tmb])(?:thousand|million|billion)\b", re.IGNORECASE)
_SCALED = re.compile(
    r"(?<![\w.,])(?P<digits>[0-9]{1,3}(?:,[0-9]{3})++|[0-9]{1,20})(?:\.(?P<dec>[0-9]{1,20}))?"
    r"[ \t]++(?P<scale>thousand|million|billion)\b(?![-'’])",
    re.IGNORECASE,
)

# Number words (rule 11): the 0..19 words, the tens, hundred and the scales.
_SMALL_WORDS = [
    *("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"),
    *("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"),
]
_SMALL = {word: value for value, word in enumerate(_SMALL_WORDS)}
_TENS_WORDS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_TENS = {word: 10 * (i + 2) for i, word in enumerate(_TENS_WORDS)}
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9}
_WORD = "(?:" + "|".join(sorted([*_SMALL, *_TENS, "hundred", *_SCALES], key=len, reverse=True)) + ")"
# A run of number words (each starts with one of the letters in the first test), possessive so that a long
# run is one match scanned once. What may follow it is checked in _word_digits, because a lookahead failing
# at the end of a long run would rescan the run from each of its words.
_WORD_RUN = re.compile(rf"\b(?=[zotfsenhmb]){_WORD}\b(?:(?:[ \t]++|-)(?:and[ \t]++)?{_WORD}\b)*+", re.IGNORECASE)
_NOT_A_NUMBER_AFTER = re.compile(r"[-'’]|[ \t]++of\b", re.IGNORECASE)  # "two-thirds", "one's", "one of"
_WORD_SPLIT = re.compile(r"[\s-]+")
# Markers worth a closer look: those whose text opens (after markup) with a digit, a LaTeX command or, for
# phrases, a number word. The rest cannot hold an answer, and skipping them in C keeps spam cheap.
_OPENS_NUMBER = r"[ \t*_:$€£({\[]*+(?:[-+]?[$€£]?\.?[0-9]|\\)"
_HASH_CANDIDATE = re.compile(rf"(?<!#)#{{4,}}+(?={_OPENS_NUMBER})")
_PHRASE_CANDIDATE = re.compile(
    rf"{_ANSWER_PHRASE.pattern}(?={_OPENS_NUMBER}|[ \t*_:({{\[]*(?=[zotfsenhmb]){_WORD}\b)", re.IGNORECASE
)


def _normalise(text: str) -> str:
    """Map non-ASCII digits and signs to ASCII, spaces to a space, and drop invisible characters (rule 12)."""
    if text.isascii():
        return text if _ASCII_CONTROL.search(text) is None else text.translate(_ASCII_TABLE)
    odd = set(text)
    odd.difference_update(_PLAIN_ASCII)
    # C-level filters over the distinct characters: no Python call per character but for the few digits.
    table: dict[int, str | None] = dict.fromkeys(map(ord, filterfalse(str.isprintable, odd)))
    table.update(dict.fromkeys(map(ord, filter(str.isspace, odd)), " "))
    for ch in filter(str.isdecimal, odd):
        table[ord(ch)] = str(unicodedata.decimal(ch))
    for ch in odd.intersection(_UNICODE_PUNCT):
        table[ord(ch)] = _UNICODE_PUNCT[ch]
    return text.translate(table)


def _frac(m: re.Match[str]) -> str:
    # "\\frac{3}{4}" -> "3/4"; a space after a digit before it makes "2\\frac12" the mixed number "2 1/2"
    glued = m.string[m.start() - 1 : m.start()].isdigit()
    return f"{' ' if glued else ''}{m[1] or m[3]}/{m[2] or m[4]} "


def _clean_latex(text: str) -> str:
    text = _LATEX_SPACING.sub("", text)
    text = _LATEX_ESCAPED.sub(r"\1", text)
    text = _LATEX_FRAC.sub(_frac, text)
    text = _LATEX_OPERATOR.sub(lambda m: _LATEX_OPERATORS[m[1]], text)
    return _LATEX_COMMAND.sub(" ", text)


def _words_value(run: str) -> int | None:
    """The value of an English cardinal such as "one hundred and twenty-five", or None if ill-formed."""
    tokens = [t for t in _WORD_SPLIT.split(run.lower()) if t]
    if tokens == ["zero"]:
        return 0
    total, group, top, last = 0, 0, 0, ""  # group: the part below 1000 being built, 0 while none is
    for token in tokens:
        after_hundred = last in ("hundred", "and") and group % 100 == 0
        if token == "and":
            ok = last in ("hundred", "scale")
            kind = "and"
        elif token in _SMALL:
            ok = _SMALL[token] > 0 and (group == 0 or after_hundred or (last == "tens" and _SMALL[token] < 10))
            group, kind = group + _SMALL[token], "small"
        elif token in _TENS:
            ok = group == 0 or after_hundred
            group, kind = group + _TENS[token], "tens"
        elif token == "hundred":
            ok = last in ("small", "tens") and group < 100
            group, kind = group * 100, "hundred"
        else:
            ok = last in ("small", "tens", "hundred") and (top == 0 or _SCALES[token] < top)
            total, group, top, kind = total + group * _SCALES[token], 0, _SCALES[token], "scale"
        if not ok:
            return None
        last = kind
    return None if last in ("", "and") else total + group


def _word_digits(m: re.Match[str]) -> str:
    """A run of number words as digits, or the run unchanged when ill-formed or followed by -, ' or "of"."""
    if _NOT_A_NUMBER_AFTER.match(m.string, m.end()):
        return m[0]
    value = _words_value(m[0])
    return m[0] if value is None else str(value)


def _scaled_digits(m: re.Match[str]) -> str:
    """ "2.5 million" as "2500000" (rule 17): a number times its scale word, exactly."""
    value = Fraction(int(m["digits"].replace(",", "") + (m["dec"] or "")), 10 ** len(m["dec"] or ""))
    return _canonical(value * _SCALES[m["scale"].lower()])


def _digits(canonical: str) -> int:
    return max(sum(c.isdigit() for c in part) for part in canonical.split("/"))


def _canonical(value: Fraction) -> str:
    p, q = value.numerator, value.denominator
    if q == 1:
        return str(p)
    rest, twos, fives = q, 0, 0
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if rest == 1:
        places = max(twos, fives)
        digits = str(abs(p) * 10**places // q).rjust(places + 1, "0")
        decimal = f"{'-' if p < 0 else ''}{digits[:-places]}.{digits[-places:]}"
        if _digits(decimal) <= MAX_DIGITS:
            return decimal
    return f"{p}/{q}"


def _value(m: re.Match[str]) -> Fraction | None:
    """The exact value of one number token, or None when it is invalid (too long, /0, huge exponent, clock)."""
    if m["clock"] is not None:  # a whole hour is that hour; any other colon-joined digits are ambiguous
        hour, _, minutes = m["clock"].partition(":")
        if minutes != "00" or len(hour) > 2:
            return None
        return Fraction(-int(hour) if m["sign"] == "-" else int(hour))
    if m["whole"] is not None:  # a mixed number: its fraction must be proper
        whole, numerator, denominator = m["whole"], m["mnum"], m["mden"]
        if max(len(whole), len(numerator), len(denominator)) > MAX_DIGITS:
            return None
        if not int(numerator) < int(denominator):
            return None
        value = int(whole) + Fraction(int(numerator), int(denominator))
    else:
        whole = (m["int"] or "0").replace(",", "").replace(" ", "")
        decimals = m["dec"] or m["dec0"] or ""
        exponent, denominator = m["exp"], m["den"]
        if len(whole) + len(decimals) > MAX_DIGITS:
            return None
        if denominator is not None and len(denominator) > MAX_DIGITS:
            return None
        if exponent is not None and len(exponent.lstrip("+-")) > 3:
            return None
        value = Fraction(int(whole + decimals), 10 ** len(decimals))
        if exponent is not None:
            if abs(int(exponent)) > _MAX_EXPONENT:
                return None
            value *= Fraction(10) ** int(exponent)
        if denominator is not None:
            if int(denominator) == 0:
                return None
            value /= int(denominator)
    if m["sign"] == "-":
        value = -value
    return value if _digits(_canonical(value)) <= MAX_DIGITS else None


def _unfinished(text: str) -> bool:
    """Whether text ends in an operator after an operand ("180/5 =", "x +"): a calculation cut off (rules 5, 6)."""
    body = text.rstrip(_TRAILING_MARKUP)
    if not body or body[-1] not in _OPERATOR_CHARS:
        return False
    operand = body[:-1].rstrip(" \t")
    return bool(operand) and (operand[-1].isalnum() or operand[-1] in ")}")


def _hedged(text: str, number: re.Match[str]) -> bool:
    """Whether the number is joined only by "or" to a next number of a different value: "18 or 20" (rule 3)."""
    following = _NUMBER.search(text, number.end())
    return (
        following is not None
        and _OR_JOIN.fullmatch(text, number.end(), following.start()) is not None
        and _value(following) != _value(number)
    )


def _result(text: str, first: re.Match[str]) -> re.Match[str]:
    """A marker's answer (rule 6): the first number, or the result of the expression it opens."""
    if not _OPERATOR_AFTER.match(text, first.end()):
        return first
    # the first number after the last equals that a number follows; each gap between two equals is searched
    # once, from the last equals back, so the work stays linear however many there are
    end = len(text)
    for equals in reversed(list(_EQUALS.finditer(text, first.end()))):
        result = _NUMBER.search(text, equals.end(), end)  # no number spans an equals sign or word
        if result is not None:
            return result
        end = equals.start()
    return first


def _segment_value(segment: str, *, number_first: bool, words: bool) -> tuple[bool, Fraction | None]:
    """What one marker says (rule 6): (False, None) when it holds no answer, else (True, value or None)."""
    segment = _clean_latex(segment)
    if words:
        segment = _WORD_RUN.sub(_word_digits, segment)
    first = _NUMBER.search(segment)
    if first is None:
        return False, None
    if number_first and first.start() > _LEADING_MARKUP.match(segment).end():
        return False, None
    if _unfinished(segment):
        return True, None
    chosen = _result(segment, first)
    return True, None if _hedged(segment, chosen) else _value(chosen)


def _last_hash_line(window: str) -> tuple[int, int, Fraction | None] | None:
    """Start, end and value of the last #### line that opens with a number (a line ends at the next ####)."""
    candidates = list(_HASH_CANDIDATE.finditer(window))
    for marker in reversed(candidates[-_MAX_CANDIDATES:]):
        start = marker.end()
        ends = (window.find("\n", start, start + _SEGMENT_CHARS), window.find("####", start, start + _SEGMENT_CHARS))
        stop = min((end for end in ends if end >= 0), default=start + _SEGMENT_CHARS)
        found, value = _segment_value(window[start:stop], number_first=True, words=False)
        if found:
            return marker.start(), stop, value
    return None


def _last_box(window: str) -> tuple[int, int, Fraction | None] | None:
    """Start, end and value of the last-opened closed box holding a number, with the hedge rule (rule 3) applied."""
    opens = {m.end() - 1: m.start() for m in _BOX_OPEN.finditer(window)}
    if not opens:
        return None
    closed: list[tuple[int, int, int]] = []  # (start of \boxed, start of its content, its closing brace)
    stack: list[int] = []
    for brace in _BRACE.finditer(window, min(opens)):  # braces before the first box cannot close one
        if brace[0] == "{":
            stack.append(brace.start())
        elif stack:
            start = stack.pop()
            if start in opens:
                closed.append((opens[start], start + 1, brace.start()))
    if not closed:
        return None
    last = max(closed)
    found, value = _segment_value(window[last[1] : last[2]], number_first=False, words=True)
    if not found:
        return None
    before = [box for box in closed if box[2] < last[0]]
    if value is not None and before:
        previous = max(before, key=lambda box: box[2])
        found_before, value_before = _segment_value(window[previous[1] : previous[2]], number_first=False, words=True)
        between = _clean_latex(window[previous[2] + 1 : last[0]])
        if found_before and value_before is not None and value_before != value and not _NUMBER.search(between):
            return last[0], last[2] + 1, None  # alternatives side by side, no work between them: a hedge
    return last[0], last[2] + 1, value


def _last_phrase(window: str) -> tuple[bool, Fraction | None, int]:
    """What the answer phrases say (rule 4): the last assertive one holding a number, else the last conditional;
    with where the phrase's sentence ends."""
    candidates = list(_PHRASE_CANDIDATE.finditer(window))
    conditional: tuple[bool, Fraction | None, int] = (False, None, len(window))
    for phrase in reversed(candidates[-_MAX_CANDIDATES:]):
        start = phrase.end()
        following = _ANSWER_PHRASE.search(window, start, start + _SEGMENT_CHARS)  # the segment ends there
        segment = window[start : following.start() if following else start + _SEGMENT_CHARS]
        end = _SENTENCE_END.search(segment)
        found, value = _segment_value(segment[: end.start()] if end else segment, number_first=True, words=True)
        if not found:
            continue
        stop = start + (end.start() if end else len(segment))
        if phrase["conditional"] is None:
            return True, value, stop
        if not conditional[0]:
            conditional = (True, value, stop)
    return conditional


def _corrected(window: str, end: int, value: Fraction | None) -> Fraction | None:
    """Rule 14: the value of prose after a marker or phrase that admits a mistake ("Wait", "Actually", "I made an
    error") and works to another number, unless its last sentence is a hypothetical; else ``value``."""
    cue = _CORRECTION.search(window, end)
    if cue is None:
        return value
    tail = window[cue.start() :]
    last = _sentence_start(tail, len(tail.rstrip(_TRAILING_MARKUP + ".")))
    if _HYPOTHETICAL.search(tail, last) is not None:
        return value
    if _CONCLUDES.search(tail, last) is None:  # "Actually, she sells 9 eggs at $2 each." restates, works nothing
        return value
    revised = _unmarked_value(tail)
    return value if revised is None else revised


def _key(m: re.Match[str]) -> str:
    """A number as written, without currency, separators and plus sign: '$1,234' and '1234' are the same."""
    return m[0].translate(_KEY_DROP)


def _sentence_start(text: str, pos: int) -> int:
    """Where the sentence holding position pos starts: after the last newline, ; ! ? or full stop before it."""
    start = max(text.rfind(end, 0, pos) for end in ("\n", ";", "!", "?"))
    return max(start, text.rfind(". ", start + 1, pos)) + 1


def _restated_result(text: str, numbers: list[re.Match[str]]) -> int:
    """Index of the answer of an unmarked reply (rule 5): the last equation's result if only repeats follow."""
    last = len(numbers) - 1
    equals = text.rfind("=", 0, numbers[last].start())
    if equals < 0:
        return last
    result = bisect_left(numbers, equals, key=re.Match.start)
    if last - result > _MAX_RESTATED:  # a restatement is a sentence or two; this many numbers are more work
        return last
    tail = [_key(m) for m in numbers[result:]]
    restated = result + max(j for j, key in enumerate(tail) if key == tail[0])
    if restated == last or numbers[restated].start() < _sentence_start(text, numbers[last].start()):
        return last  # the result must be in the final sentence: one that names another value chose it
    # every number after the restated result must repeat one written before it (compared as written, in C), or
    # restate the question's data: "for 16 glasses at $5 and 60% of $5" (rule 13)
    written = {key.translate(_KEY_DROP) for key in set(map(itemgetter(0), numbers[:restated]))}
    if written.issuperset(tail[restated - result + 1 :]):
        return restated
    data = False  # whether the number before was restated data ("and" carries it on)
    for before, number in zip(numbers[restated:last], numbers[restated + 1 :], strict=True):
        word = _DATA_BEFORE.search(text, before.end(), number.start())
        data = word is not None and (word["word"].lower() != "and" or data)
        if not data and _key(number) not in written:
            return last
    return restated


def _period(m: re.Match[str], name: str) -> str:
    word = (m[name] or m[f"{name}_adj"]).lower().removesuffix("s")
    return {"daily": "day", "hourly": "hour", "weekly": "week", "monthly": "month", "yearly": "year"}.get(word, word)


def _converted_rate(text: str, numbers: list[re.Match[str]], chosen: int) -> int:
    """Rule 16: the rate stated before an aside that converts it to another period ("18 dollars a day, which is
    126 a week") is the answer, not the converted figure."""
    first = chosen  # the first number of the expression the converted figure is the result of, if any
    while first > 0 and _OPERATORS_ONLY.fullmatch(text, numbers[first - 1].end(), numbers[first].start()):
        first -= 1
    if first == 0:
        return chosen
    aside = _RATE_ASIDE.match(text, numbers[first - 1].end(), numbers[first].start())
    after = _RATE_AFTER.match(text, numbers[chosen].end()) if aside else None
    if aside is None or after is None or _period(aside, "first") == _period(after, "second"):
        return chosen
    return first - 1


def _rejected(text: str, number: re.Match[str]) -> bool:
    """Rule 15: a value the reply rejects ("12, not 18", "instead of 18") is never its answer."""
    return _REJECTED_BEFORE.search(text, max(0, number.start() - 24), number.start()) is not None


def _unmarked_value(window: str) -> Fraction | None:
    """Rule 5: the last number, unless the reply was cut off mid-calculation or ends by restating data."""
    text = _clean_latex(window)
    if _unfinished(text):
        return None
    numbers = [number for number in _NUMBER.finditer(text) if not _rejected(text, number)]
    if not numbers:
        return None
    return _value(numbers[_converted_rate(text, numbers, _restated_result(text, numbers))])


def _extract_value(text: str) -> Fraction | None:
    """extract_answer without the safety net: the value, or None. Raises only on a bug."""
    if not isinstance(text, str):
        return None
    window = text[-WINDOW:]
    if len(text) > WINDOW:  # the cut may have split a number or a word: drop its tail (rule 1)
        window = window[_CUT_TAIL.match(window).end() :]
    window = _normalise(window)

    window = _SCALED.sub(_scaled_digits, window) if _SCALE_WORD.search(window) else window  # rule 17

    markers = [marker for marker in (_last_hash_line(window), _last_box(window)) if marker is not None]
    if markers:
        _, end, value = max(markers, key=lambda marker: marker[0])
        return _corrected(window, end, value)
    found, value, end = _last_phrase(window)
    if found:
        return _corrected(window, end, value)
    return _unmarked_value(window)


def _safe_value(text: object) -> Fraction | None:
    try:
        return _extract_value(text)  # type: ignore[arg-type]
    except Exception as error:  # a reward function must never take a training run down
        warnings.warn(f"sao.tasks.gsm8k.grading: internal error {error!r}; graded as no answer", stacklevel=3)
        return None


def extract_answer(text: str) -> str | None:
    """The final numeric answer in ``text`` as a canonical string (see the module doc), or None."""
    value = _safe_value(text)
    return None if value is None else _canonical(value)


def math_equal(completion: str, gold: str) -> bool:
    """True iff both strings hold a final answer and the two are equal as exact rationals."""
    answer = _safe_value(completion)
    if answer is None:
        return False
    expected = _safe_value(gold)
    return expected is not None and answer == expected


def reward(completion: str, gold: str) -> float:
    """1.0 if ``math_equal(completion, gold)`` else 0.0: the terminal reward trainers call."""
    return 1.0 if math_equal(completion, gold) else 0.0
