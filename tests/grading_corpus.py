"""Hostile inputs for sao.core.grading: each must grade without an exception and inside the time bound.

``NASTY`` is a list of (name, text), built at import (the largest strings are a few MB, built once).
"""

from __future__ import annotations

import random

_rng = random.Random(17)
_MB = 1_000_000

NASTY: list[tuple[str, str]] = [
    ("empty", ""),
    ("only spaces", " " * _MB),
    ("1 MB of prose, answer at the end", "The eggs cost money. " * (_MB // 21) + "#### 18"),
    ("1 MB of prose, no answer", "lorem ipsum dolor " * (_MB // 18)),
    ("power tower", "9**9**9**9"),
    ("power tower, boxed", r"\boxed{9^{9^{9^{9}}}}"),
    ("huge exponent", "1e999999999"),
    ("huge negative exponent", "#### 1e-999999999"),
    ("caret tower", "10^10^10"),
    ("million-digit number", "1" * _MB),
    ("million-digit number after a marker", "#### " + "9" * _MB),
    ("million-digit decimal", "0." + "3" * _MB),
    ("million-digit denominator", "1/" + "7" * _MB),
    ("million thousands groups", "1" + ",000" * (_MB // 4)),
    ("thousands groups then a glued digit", "1" + ",111" * 2000 + "1"),
    ("nested boxes 100000 deep, unclosed", r"\boxed{" * 100_000),
    ("nested boxes 100000 deep, closed", r"\boxed{" * 100_000 + "18" + "}" * 100_000),
    ("nested empty boxes", r"\boxed{" * 600 + "}" * 600 + " 18"),
    ("unclosed box", r"The answer is \boxed{18"),
    ("closing braces only", "}" * _MB),
    ("opening braces only", "{" * _MB),
    ("many boxes", r"\boxed{1} " * 50_000),
    ("many markers", "#### " * 200_000),
    ("many markers with words", "#### Step one\n" * 70_000),
    ("many phrases", "the answer is " * 70_000),
    ("many phrases with colons", "answer: answer is answer = " * 40_000),
    ("thousands of numbers", " ".join(str(_rng.randrange(10**9)) for _ in range(200_000))),
    ("comma soup", "1," * 500_000),
    ("dot soup", "1." * 500_000),
    ("slash soup", "1/" * 500_000),
    ("minus soup", "-" * _MB + "5"),
    ("exponent soup", "1e1e1e1e" * 100_000),
    ("frac soup", r"\frac{1}{" * 100_000),
    ("dfrac nested", r"\dfrac{\dfrac{1}{2}}{\dfrac{3}{4}}"),
    ("latex commands", r"\text{" * 100_000 + r"\$" * 1000),
    ("NUL bytes", "\x00" * _MB + "18"),
    ("NUL inside number", "1\x008"),
    ("RTL marks", "\u200f\u202e#### \u200f18\u202c"),
    ("zero-width everywhere", "\u200b".join("#### 1234")),
    ("Arabic-Indic digits", "#### \u0661\u0662\u0663\u066c\u0664\u0665\u0666"),
    ("fullwidth digits", "\uff03\uff03\uff03\uff03 \uff11\uff18"),
    ("unicode minus", "#### \u221218"),
    ("mathematical bold digits", "#### \U0001d7cf\U0001d7d6"),
    ("vulgar fraction", "#### \u00bd"),
    ("superscripts", "10\u00b2\u00b3"),
    (
        "mixed scripts 1 MB",
        "".join(chr(_rng.choice([0x661, 0xFF11, 0x967, 0x30, 0x200F, 0x2212])) for _ in range(_MB)),
    ),
    ("lone surrogates", "\ud800\udfff 18 \udc80"),
    ("random binary", bytes(_rng.randrange(256) for _ in range(_MB)).decode("utf-8", errors="replace")),
    ("random unicode", "".join(chr(_rng.randrange(0x110000)) for _ in range(200_000))),
    ("python payload", "__import__('os').system('touch /tmp/sao_pwned')"),
    ("eval payload in box", r"\boxed{__import__('os').system('echo 18')}"),
    ("format string", "{0.__class__.__mro__[1].__subclasses__()} %s %n #### 18"),
    ("regex bait: spaces before slash", "1" + " " * _MB + "x"),
    ("regex bait: spaces after phrase", "answer is" + " " * _MB),
    ("regex bait: stars after phrase", "answer" + "*" * _MB + "is 18"),
    ("regex bait: digits comma", "1" * 1000 + ",000" * 1000),
    ("line of hashes", "#" * _MB),
    ("long line after marker", "#### " + "x" * _MB + " 18"),
]
