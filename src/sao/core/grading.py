r"""Grade a model's reply against a GSM8K gold answer: exact, bounded in time, never executing anything.

The SAO reward (SPEC section 3) is 1 if the final answer of a reply equals the GSM8K gold numerically,
else 0. ``reward(completion, gold)`` is that program; it wraps ``math_equal``, which compares the numbers
``extract_answer`` finds in the two strings as exact ``fractions.Fraction`` values. ``gold`` is a GSM8K
answer field (a worked solution ending in ``#### N``) or a bare number such as ``"18"`` or ``"1,000"``;
both go through the same extraction.

Which number counts. Only the last ``WINDOW`` = 4096 characters are read (final answers are at the end;
when a text is longer, a number or word cut in two at the edge is dropped). In priority order:

1. The last final-answer *marker* by position, of two kinds:
   a ``####`` line that starts with a number (``#### 18``, ``#### $1,234.50``, ``#### **18**``) -- a
   line that starts with a word, like the markdown heading ``#### Step 2``, is not a marker; or a closed
   ``\boxed{...}`` / ``\fbox{...}`` that contains a number (of nested boxes, the innermost).
2. Else the last "answer is N" phrase -- ``answer is|was|would be|will be|should be``, ``answer:``,
   ``answer =``, any case, markdown ``**`` allowed -- immediately followed by a number.
3. Else the last number in the text.

Inside a marker (the rest of the ``####`` line, the box, the phrase up to the end of its sentence) the
answer is the first number after the last ``=`` if one follows it (``\boxed{9 \times 2 = 18}`` is 18),
else the first number. If the chosen number is invalid (below) the answer is None: no rule falls back
past a number it has chosen.

What a number is. An optional sign (``-``, ``+``, U+2212), an optional ``$``/``€``/``£``, digits
with optional thousands groups (a comma is a separator only before exactly three digits: ``1,234`` is
1234; ``1, 2, 3`` and ``1,2,3`` are three numbers), an optional decimal part (``.5`` is 0.5; ``5.`` is 5
and a full stop), an optional exponent (``2.5e3``) and an optional integer denominator (``3/4``,
``\frac{3}{4}``, ``\dfrac``, ``\tfrac``). A number must not be glued to a preceding letter, digit,
underscore or dot (``x2`` holds no number); anything may follow it, so units and signs are ignored:
``18%``, ``18 eggs``, ``18.00``, ``\boxed{\$18}`` and ``\boxed{18 \text{ dollars}}`` are all 18. Valid
means: at most ``MAX_DIGITS`` = 40 digits in each digit string as written, an exponent of at most 40 in
magnitude, a non-zero denominator, and a canonical form with at most 40 digits on each side of ``/``.

Canonical form (what ``extract_answer`` returns): the reduced fraction written as an integer (``"-3"``),
else as an exact decimal when the denominator has no prime factor but 2 and 5 (``"1234.5"``, ``"0.75"``
for ``3/4``), else as ``"p/q"`` (``"1/3"``, ``"-2/7"``; also used when the decimal would exceed 40
digits). Each rational has one canonical string, and ``extract_answer`` returns a canonical string
unchanged.

Unicode. Decimal digits of any script (Arabic-Indic, fullwidth, Devanagari, mathematical bold) are read
as digits; U+2212 and fullwidth signs and punctuation map to ASCII; format characters (RTL/LTR marks,
zero-width spaces, BOM) are dropped; other spaces and control characters (NUL) separate tokens. Vulgar
fractions (``½``), superscripts, number words and letter look-alikes (``O`` for 0) are not digits.

Time bound: under 50 ms per call for any ``str`` of any length on one CPU core (measured worst case
about 3 ms per extraction, on ``"#### " * 200000`` from the corpus in ``tests/grading_corpus.py``; a
GSM8K-sized reply takes about 0.02 ms; the tests assert the 50 ms on every corpus entry). It holds by
construction: a fixed-size window, regexes with no nested or overlapping quantifiers, one iterative
pass for brace matching (no recursion, so ``\boxed{`` nested 100000 deep is fine), digit strings capped
before any ``int`` conversion (``9**9**9**9`` and ``10^10^10`` are several small numbers;
``1e999999999`` is invalid).

Deliberately left out: ``eval``, ``exec``, sympy or any parser of expressions; arithmetic (``2^10`` is
the numbers 2 and 10); symbolic algebra; unit or percent conversion (``50%`` is 50, 18 hours is not
1080 minutes); tolerance (``0.333`` is not ``1/3``); numbers in words; spaces as thousands separators;
judging the reasoning. Non-``str`` input gives None / False / 0.0 rather than an exception, and an
internal error (a bug) is warned about and counted as no answer, so a reward call never takes a
training run down.
"""

from __future__ import annotations

import re
import unicodedata
import warnings
from collections import deque
from fractions import Fraction

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

_NUMBER = re.compile(
    r"""
    (?<![A-Za-z0-9_.])                      # not glued to a word, a number or a dot
    (?P<sign>[-+])?
    [$€£]?
    (?:
        (?P<int>[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.(?P<dec>[0-9]+))?
      | \.(?P<dec0>[0-9]+)
    )
    (?:[eE](?P<exp>[-+]?[0-9]+))?
    (?:[ \t]*/[ \t]*(?P<den>[0-9]+)(?!\.[0-9]))?
    """,
    re.VERBOSE,
)
_HASH_MARKER = re.compile(r"#{4,}")
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)[ \t]*\{")
_BRACE = re.compile(r"[{}]")
_ANSWER_PHRASE = re.compile(
    r"\banswer\b[ \t*_]*(?:(?:is|was|(?:would|will|should)[ \t]+be)\b[ \t*_]*[:=]?|[:=])",
    re.IGNORECASE,
)
_SENTENCE_END = re.compile(r"[\n;!?]|\.(?=\s|$)")
_LEADING_MARKUP = re.compile(r"[ \t*_:$€£({\[]*")
_PARTIAL_TOKEN = re.compile(r"[0-9A-Za-z_.,]*")
# LaTeX clean-up, applied in this order.
_LATEX_SPACING = re.compile(r"\\[,!;: ]|\{,\}")
_LATEX_ESCAPED = re.compile(r"\\([$%])")
_LATEX_FRAC = re.compile(
    r"\\[dt]?frac[ \t]*(?:\{[ \t]*([-+]?[0-9.,]+)[ \t]*\}[ \t]*\{[ \t]*([0-9]+)[ \t]*\}|([0-9])([0-9]))"
)
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")


def _normalise(text: str) -> str:
    """Map non-ASCII digits and signs to ASCII, drop format characters, other odd characters to spaces."""
    if text.isascii():
        return text
    table: dict[int, str] = {}
    for ch in set(text):
        if ch.isascii():
            continue
        digit = unicodedata.decimal(ch, None)
        if digit is not None:
            table[ord(ch)] = str(digit)
        elif ch in _UNICODE_PUNCT:
            table[ord(ch)] = _UNICODE_PUNCT[ch]
        else:
            category = unicodedata.category(ch)
            if category == "Cf":
                table[ord(ch)] = ""
            elif category[0] in "ZC":
                table[ord(ch)] = " "
    return text.translate(table)


def _frac(m: re.Match[str]) -> str:
    # "\\frac{3}{4}" -> "3/4"; a space keeps it apart from a digit before it ("2\\frac12" is not 21/2)
    glued = m.string[m.start() - 1 : m.start()].isdigit()
    return f"{' ' if glued else ''}{m[1] or m[3]}/{m[2] or m[4]} "


def _clean_latex(text: str) -> str:
    text = _LATEX_SPACING.sub("", text)
    text = _LATEX_ESCAPED.sub(r"\1", text)
    text = _LATEX_FRAC.sub(_frac, text)
    return _LATEX_COMMAND.sub(" ", text)


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
    """The exact value of one number token, or None when it is invalid (too long, /0, huge exponent)."""
    whole = (m["int"] or "0").replace(",", "")
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


def _segment_answer(segment: str, number_first: bool) -> re.Match[str] | None:
    """The number a marker's segment holds: after the last '=', else the first; None if none.

    With number_first, the segment counts only if it opens with a number (after markup and spaces).
    """
    segment = _clean_latex(segment)
    first = _NUMBER.search(segment)
    if first is None:
        return None
    if number_first and first.start() > _LEADING_MARKUP.match(segment).end():
        return None
    equals = segment.rfind("=")
    if equals > first.start():
        after = _NUMBER.search(segment, equals + 1)
        if after is not None:
            return after
    return first


def _last_box(window: str) -> tuple[int, str] | None:
    """Start and content of the last-opened \\boxed{...} that is closed, by one iterative brace pass."""
    opens = {m.end() - 1: m.start() for m in _BOX_OPEN.finditer(window)}
    if not opens:
        return None
    stack: list[int] = []
    best: tuple[int, str] | None = None
    for brace in _BRACE.finditer(window):
        if brace[0] == "{":
            stack.append(brace.start())
        elif stack:
            start = stack.pop()
            if start in opens and (best is None or opens[start] > best[0]):
                best = (opens[start], window[start + 1 : brace.start()])
    return best


def _last_hash_line(window: str) -> tuple[int, re.Match[str]] | None:
    """Start and number of the last #### line that opens with a number (segments end at the next ####)."""
    markers = list(_HASH_MARKER.finditer(window))
    for i in range(len(markers) - 1, -1, -1):
        start = markers[i].end()
        stop = min(markers[i + 1].start() if i + 1 < len(markers) else len(window), start + _SEGMENT_CHARS)
        newline = window.find("\n", start, stop)
        number = _segment_answer(window[start : newline if newline >= 0 else stop], number_first=True)
        if number is not None:
            return markers[i].start(), number
    return None


def _last_phrase(window: str) -> re.Match[str] | None:
    """Number of the last "answer is N" phrase followed directly by a number, up to its sentence's end."""
    phrases = list(_ANSWER_PHRASE.finditer(window))
    for i in range(len(phrases) - 1, -1, -1):
        start = phrases[i].end()
        stop = min(phrases[i + 1].start() if i + 1 < len(phrases) else len(window), start + _SEGMENT_CHARS)
        segment = window[start:stop]
        end = _SENTENCE_END.search(segment)
        number = _segment_answer(segment[: end.start()] if end else segment, number_first=True)
        if number is not None:
            return number
    return None


def _extract_value(text: str) -> Fraction | None:
    """extract_answer without the safety net: the value, or None. Raises only on a bug."""
    if not isinstance(text, str):
        return None
    window = _normalise(text[-WINDOW:])
    if len(text) > WINDOW:  # the cut may have split a number or a word: drop its tail
        window = window[_PARTIAL_TOKEN.match(window).end() :]

    markers: list[tuple[int, re.Match[str]]] = []
    hash_line = _last_hash_line(window)
    if hash_line is not None:
        markers.append(hash_line)
    box = _last_box(window)
    if box is not None:
        number = _segment_answer(box[1], number_first=False)
        if number is not None:
            markers.append((box[0], number))
    if markers:
        return _value(max(markers, key=lambda marker: marker[0])[1])

    number = _last_phrase(window)
    if number is not None:
        return _value(number)

    last = deque(_NUMBER.finditer(_clean_latex(window)), maxlen=1)
    return _value(last[0]) if last else None


def _safe_value(text: object) -> Fraction | None:
    try:
        return _extract_value(text)  # type: ignore[arg-type]
    except Exception as error:  # a reward function must never take a training run down
        warnings.warn(f"sao.core.grading: internal error {error!r}; graded as no answer", stacklevel=3)
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
