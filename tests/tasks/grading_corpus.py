"""Hostile inputs for sao.tasks.gsm8k.grading: each must grade without an exception and inside the time bound.

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
    ("mixed scripts 1 MB", "".join(chr(_rng.choice([0x661, 0xFF11, 0x967, 0x30, 0x200F, 0x2212])) for _ in range(_MB))),
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
    # inputs aimed at the rules for clock times, grouping, mixed numbers, words, hedges and restatements
    ("clock soup", "1:" * 500_000 + "1"),
    ("clock soup after a marker", "#### " + "1:" * 2000),
    ("space-grouped soup", "The total is 1" + " 000" * 1000),
    ("mixed-number soup", "1 1/2 " * 200_000),
    ("number words in phrases", "the answer is twenty-one " * 100_000),
    ("number words in a box", "\\boxed{" + "one hundred and " * 250 + "five}"),
    ("number-word run then of", "The answer is " + "one " * 1000 + "of them"),
    ("hedged boxes", "\\boxed{1} or \\boxed{2} " * 100_000),
    ("or soup", "1 or 2 or " * 100_000),
    ("or soup in a box", "\\boxed{" + "1 or 2 or " * 400 + "1}"),
    ("equals soup", "1 = 2 " * 200_000),
    ("restated numbers", "1 + 1 = 2. " + "1 2 " * 1000),
    ("operator tail", "2 + " * 300_000),
    ("conditional phrases", "the answer would be 7. " * 100_000),
    ("phrases with LaTeX and no number", "the answer is \\x " * 200_000),
    ("#### lines with LaTeX and no number", "#### \\x\n" * 200_000),
    ("operand then many equals", "\\boxed{1/2 of " + "is = " * 800 + "18}"),
    ("spaces after a #### in the window", "####" + " " * 4000 + "x"),
    ("spaces inside a box opening", "\\boxed" + " " * 4000 + "{18}"),
    ("spaces inside a cut number", "1" * 5000 + " " * 3000 + "/4"),
    ("spaces after a phrase in the window", "answer is" + " " * 4000 + "x"),
    ("stars after a phrase in the window", "answer is" + "*" * 4000 + "x"),
    ("dollars after a phrase", "answer is " + "$" * 4000 + "x"),
    ("spaces after a number word", "The answer is one" + " " * 4000 + "x"),
    ("spaces after an operand in a box", "\\boxed{18" + " " * 4000 + "x}"),
    ("spaces before or in a box", "\\boxed{18" + " " * 4000 + "or 20}"),
    ("operand chain in a box", "\\boxed{1/2 of 36 is " + "1 + " * 1000 + "1}"),
    # inputs aimed at rules 13-17: restated data, corrections, rejected values, converted rates, scale words
    ("data soup after a result", "1 + 1 = 2. So 2 " + "for 3 at 4 and 5 of " * 2000),
    ("correction cues after a box", "\\boxed{1} " + "wait actually oops 1 = 2 " * 50_000),
    ("not soup", "not " * 200_000 + "5"),
    ("rate asides", "18 dollars a day, which is " * 100_000 + "126 a week"),
    ("scale soup", "2.5 million " * 100_000),
    ("scale words with long digits", "9" * 30 + ".5" + "5" * 30 + " billion"),
]

# Realistic replies to GSM8K-style questions, each labelled by hand the way a careful grader who has read the
# question would: ``correct`` is True when the reply commits to the gold value as its final answer, and False
# when it gives another value, several values (a hedge), no value in the unit asked, or was cut off before
# giving one. Grouped by the kind of reply each probes; "plain" are the everyday cases every rule must keep.
# Entries: (kind, reply, gold, correct).
LABELLED: list[tuple[str, str, str, bool]] = [
    # everyday replies
    (
        "plain",
        "Janet has 16 - 3 - 4 = 9 eggs left.\nShe sells them for $2 each, so she makes 9 * 2 = $18.\n\n"
        "The answer is 18.",
        "18",
        True,
    ),
    ("plain", "She sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 = 18 dollars.\n#### 18", "18", True),
    (
        "plain",
        r"She keeps 16 - 3 - 4 = 9 eggs to sell. Therefore, Janet makes \(\boxed{18}\) dollars every day.",
        "18",
        True,
    ),
    ("plain", "She sells 16 - 3 = 13 eggs and makes 13 * 2 = $26.\nThe answer is 26.", "18", False),
    (
        "plain",
        "The robe needs 2 / 2 = 1 bolt of white fiber.\nIn total it takes 2 + 1 = 3 bolts.\n\n**Final Answer:** 3",
        "3",
        True,
    ),
    (
        "plain",
        "The total cost is 80,000 + 50,000 = $130,000.\nThe value rises by 80,000 * 1.5 = 120,000, to 200,000.\n"
        "Profit: 200,000 - 130,000 = 70,000.\n\\boxed{70000}",
        "70000",
        True,
    ),
    ("plain", "So his profit is $200,000 - $130,000 = $70,000.", "70000", True),
    (
        "plain",
        "He runs 3 x 3 = 9 sprints.\nEach is 60 meters, so 9 x 60 = 540 meters.\nThe answer is: 540",
        "540",
        True,
    ),
    ("plain", "3 cups × 20 chickens = 60 cups a day. 60 − 15 − 25 = 20.\n\n#### 20", "20", True),
    ("plain", r"The cheap glasses cost 8 \times 3 = 24 and the rest 8 \times 5 = 40, so \boxed{48}", "64", False),
    ("plain", "Each slice costs 12 / 8 = $1.50.\nThe answer is $1.50", "1.5", True),
    ("plain", "The temperature ends at 6 - 10 = -4 degrees.\n#### -4", "-4", True),
    ("plain", "In total she spends 5 + 7 + 8 = 20 dollars.", "20", True),
    ("plain", "The answer is 1,200 dollars.", "1200", True),
    ("plain", "The answer is 18 dollars.", "20", False),
    ("plain", "**Answer: $1,234.50**", "1234.5", True),
    ("plain", r"The final answer is $\boxed{\$42}$.", "42", True),
    ("plain", "She needs 7 more boxes.\n\nAnswer: 7 boxes", "7", True),
    # the final sentence restates the question's numbers after an unmarked answer
    (
        "restated",
        "Janet has 16 - 3 - 4 = 9 eggs left to sell.\nShe makes 9 * $2 = $18.\nTherefore, Janet makes $18 every "
        "day at the farmers' market by selling 9 duck eggs at $2 each.",
        "18",
        True,
    ),
    (
        "restated",
        "James runs 3 * 3 = 9 sprints a week.\nHe runs 9 * 60 = 540 meters.\nSo James runs 540 meters a week: "
        "3 sprints, 3 times a week, 60 meters each.",
        "540",
        True,
    ),
    (
        "restated",
        "Wendi needs 3 * 20 = 60 cups a day. She has given 15 + 25 = 40 cups, so the final meal needs "
        "60 - 40 = 20 cups, for her 20 chickens at 3 cups each.",
        "20",
        True,
    ),
    (
        "restated",
        "The white fiber is 2 / 2 = 1 bolt. The total is 2 + 1 = 3 bolts (2 bolts of blue fiber and 1 bolt of "
        "white fiber).",
        "3",
        True,
    ),
    (
        "restated",
        "20 - 5 = 15 apples.\n\nQuestion: Sara had 20 apples and gave 5 to her friend. How many does she have?",
        "15",
        True,
    ),
    (
        "restated",
        "Kylar pays 8 * 3 = $24 for the cheaper glasses and 8 * 5 = $40 for the rest, so 24 + 40 = $64 in total "
        "for 16 glasses at $5 and 60% of $5.",
        "64",
        True,
    ),
    ("restated", "3 + 4 = 7 cats. She adopts 7 more, so she has 14 cats.", "14", True),
    ("restated", "4 * 5 = 20 cookies. She eats 3, so 17 are left.", "17", True),
    ("restated", "Each box holds 6 * 2 = 12 eggs and there are 12 boxes, so she has 144 eggs.", "144", True),
    ("restated", "She has 3 cats and 4 dogs, so she has 7 pets.", "7", True),
    ("restated", "He buys 5 * 4 = 20 pens. He gives away 5, so 15 remain.", "15", True),
    ("restated", "Each box holds 6 * 2 = 12 eggs, so 3 boxes hold 36 eggs.", "12", False),
    (
        "restated",
        "The first job pays 3 * 50 = $150, the second 2 * 50 + 5 * 30 = $250 and the third 50 + 2 * 40 = $130.\n"
        "Therefore, the most money he can earn is $250.",
        "250",
        True,
    ),
    # hedges, revisions and repetitions
    (
        "hedge",
        "She makes 9 * 2 = 18 dollars a day, or 13 * 2 = 26 if she also sells the muffin eggs. The answer is "
        r"\boxed{18} or \boxed{26}.",
        "18",
        False,
    ),
    ("hedge", r"The answer is $\boxed{20}$ or $\boxed{18}$, depending on whether she eats the eggs.", "18", False),
    ("hedge", "**Final Answer**\n\\boxed{16}\n\n**Alternative Answer**\n\\boxed{18}", "18", False),
    ("hedge", "The answer is 18 or 20.", "18", False),
    ("hedge", r"\boxed{18 \text{ or } 20}", "20", False),
    ("hedge", "So she makes either 18 or 20 dollars a day.", "20", False),
    (
        "hedge",
        "\\boxed{26}\n\nWait, she eats 3 and bakes 4, so she sells 16 - 3 - 4 = 9 eggs: 9 * 2 = 18.\n\n\\boxed{18}",
        "18",
        True,
    ),
    ("hedge", "She makes \\boxed{18} dollars.\n\n**Final Answer**\n\\boxed{18}", "18", True),
    ("hedge", r"The answer is \boxed{18} (that is, \boxed{18.00} dollars).", "18", True),
    ("hedge", "The answer is 18 dollars, or 1800 cents.", "18", True),
    ("hedge", "Step 1: eggs left = \\boxed{9}\nStep 2: money = 9 × 2 = \\boxed{18}", "18", True),
    ("hedge", "The answer is 18 (or $18.00).", "18", True),
    ("hedge", "She saved $350 - $140 = $210, which is 210 / 350 = 0.60 or 60% off.", "60", True),
    # cut off in the middle of a calculation
    ("truncated", "Five friends share the $180 bill equally. Each pays 180/5 =", "36", False),
    ("truncated", "The total cost is 12 + 15 + 9 =", "36", False),
    ("truncated", "First, she has 20 - 5 = 15 apples. Then she buys 3 more, so 15 + 3 =", "18", False),
    ("truncated", r"The area is $12 \times 3 =", "36", False),
    ("truncated", "The answer is 180 / 5 =", "36", False),
    ("truncated", "Each pays 180/5 = 36 dollars.", "36", True),
    ("truncated", "So the answer is 9 * 2 = 18.\n\n---", "18", True),
    ("truncated", "The answer is 36. Let me double-check: 180 / 5 =", "36", True),
    ("truncated", "\\boxed{36}\n\nCheck: 36 * 5 =", "36", True),
    # clock times
    ("clock", "She walks for 45 + 45 = 90 minutes, which is 1:30.", "90", True),
    ("clock", "The answer is 1:30.", "90", True),
    ("clock", "#### 1:30", "1.5", True),
    ("clock", "She will eat dinner at 7:00 pm.\n#### 7:00", "7", True),
    ("clock", "Jordan must start at 2:00 pm at the latest.", "2", True),
    ("clock", "She starts at 8:00 and works 3 + 2 + 2 = 7 hours.", "7", True),
    ("clock", "He left at 7:50 and the bus left at 7:30, so he missed it by 20 minutes.", "20", True),
    ("clock", "Answer: 90 minutes", "90", True),
    # spaces as thousands separators
    ("thousands", "The house now costs 1 000 + 250 = 1 250 dollars.", "1250", True),
    ("thousands", "The answer is 12 500 dollars.", "12500", True),
    ("thousands", "#### 1\u202f000", "1000", True),
    ("thousands", r"\boxed{2\,400}", "2400", True),
    ("thousands", "She pays with 5 100-dollar bills, so she gets 500 - 470 = 30 dollars back.", "30", True),
    ("thousands", "The 3 teams have 12 players each, so 3 * 12 = 36 players.", "36", True),
    ("thousands", "In 2023 100 people came.", "100", True),
    # number words
    ("words", "She has 16 - 3 - 4 = 9 eggs left, which sell for $2 each. The answer is eighteen.", "18", True),
    ("words", r"\boxed{\text{eighteen}}", "18", True),
    ("words", "The answer is one hundred and five.", "105", True),
    ("words", "Final answer: twenty-five dollars", "25", True),
    ("words", "The answer is one of the two options above: 5 or 7.", "5", False),
    ("words", "Each of the two boys gets 3 apples.", "3", True),
    ("words", "So in total she has eighteen eggs.", "18", True),
    # a hypothetical after the answer
    ("hypothetical", "The answer is 18. If she sold all 16 eggs instead, the answer would be 32.", "18", True),
    ("hypothetical", "**Answer:** 7\n\n(If the question meant weeks, the answer would have been 49.)", "7", True),
    ("hypothetical", "The answer is 5; with one more friend the answer could be 4.", "5", True),
    ("hypothetical", "If she ate none, the answer would be 24. But she eats 6, so the answer is 18.", "18", True),
    ("hypothetical", "The answer would be 12 apples.", "12", True),
    # mixed numbers
    ("mixed", "Each cake needs 1 1/2 cups, so 7 cakes need 7 * 1.5 = 10.5 cups. She needs 3 1/2 more.", "3.5", True),
    ("mixed", "#### 2 3/4", "2.75", True),
    ("mixed", r"She walks $2\frac{1}{2}$ miles.", "2.5", True),
    ("mixed", "Each friend gets 3/4 of a pizza.", "0.75", True),
    ("mixed", "He ran 5 1/4 miles on Monday and 3 3/4 miles on Tuesday, 9 miles in total.", "9", True),
    # the result of an expression in the final statement
    ("expression", "The answer is 1/2 of 36, which is 18.", "18", True),
    ("expression", "The answer is 50% of 36, which is 18 students.", "18", True),
    ("expression", "#### 3 times 6 is 18", "18", True),
    ("expression", r"\boxed{5 \text{ apples} + 13 \text{ apples} = 18 \text{ apples}}", "18", True),
    ("expression", "The answer is 18, which is 9 times 2.", "18", True),
    ("expression", r"\boxed{18 = 9 \times 2}", "18", True),
    ("expression", "The answer is 1/2.", "0.5", True),
    ("expression", r"The answer is \boxed{9 \times 2}.", "18", True),
    # the answer restated at the end, with the question's data after it and no marker (rule 13)
    (
        "restated data",
        "Janet has 16 - 3 - 4 = 9 eggs left. She sells them for 9 * 2 = $18. So Janet makes $18 every day from "
        "her 16 eggs at $2 each.",
        "18",
        True,
    ),
    ("restated data", "The robe takes 2 + 1 = 3 bolts in all, 3 bolts for 2 of blue and 1 of white.", "3", True),
    # a boxed or stated answer corrected later in prose (rule 14)
    (
        "correction",
        "She makes 16 * 2 = 32 dollars.\n\n\\boxed{32}\n\nWait, she eats 3 and bakes with 4, so she sells "
        "16 - 3 - 4 = 9 eggs, which is 9 * 2 = 18 dollars.",
        "18",
        True,
    ),
    ("correction", "The answer is 26.\n\nActually, I made a mistake: 9 * 2 = 18.", "18", True),
    ("correction", "\\boxed{18}\n\nWait, let me double-check: 9 * 2 = 18. Correct.", "18", True),
    # a correction in prose with no marker at all (rule 15)
    ("correction", "So she makes 9 * 2 = $18, not $26.", "18", True),
    ("correction", "The total is 24 + 40 = 64 dollars rather than 48.", "64", True),
    # a rate restated after the answer (rule 16)
    ("rate", "She makes 9 * 2 = 18 dollars a day, which is 18 * 7 = 126 dollars a week.", "18", True),
    ("rate", "He earns 12 * 5 = 60 dollars per hour (that's 2400 dollars per week).", "60", True),
    ("rate", "She reads 20 pages a day, so in a week she reads 20 * 7 = 140 pages.", "140", True),
    # scaled number words (rule 17)
    ("scaled", "The town grows from 2 million to 2.5 million people.", "2500000", True),
    ("scaled", "The company is worth $1.2 billion.\n#### 1.2 billion", "1200000000", True),
]
