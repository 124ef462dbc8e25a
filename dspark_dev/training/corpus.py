"""Seeded synthetic GSM8K-style corpus: arithmetic word problems with worked answers.

Pure Python (``random.Random`` with fixed seeds only), so the same seed gives the same text on every
machine and Python version >= 3.10. Each problem has a ``question`` and an ``answer`` in the GSM8K
format: worked steps with ``<<a+b=c>>`` calculator annotations, then a final line ``#### <number>``.

Splits: the held-out set is drawn from its own seed stream (``HELDOUT_SEED``); the training stream
skips every question that is in the held-out set, so no held-out question is ever trained on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass

TRAIN_SEED = 1234
HELDOUT_SEED = 98765
DEFAULT_HELDOUT_SIZE = 256

NAMES = [
    "Tom",
    "Anna",
    "Ben",
    "Maria",
    "Sam",
    "Lily",
    "Jack",
    "Emma",
    "Noah",
    "Mia",
    "Leo",
    "Zoe",
    "Omar",
    "Ivy",
    "Max",
    "Nina",
    "Ravi",
    "Sara",
    "Paul",
    "Kate",
]
ITEMS = [
    "apples",
    "pencils",
    "books",
    "marbles",
    "cookies",
    "stickers",
    "cards",
    "eggs",
    "shells",
    "flowers",
    "coins",
    "toys",
    "candies",
    "stamps",
    "balloons",
    "oranges",
]
CONTAINERS = ["boxes", "bags", "baskets", "jars", "packs", "crates"]
PLACES = ["the store", "the market", "the fair", "the bakery", "the shop"]


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # worked solution ending in "#### <number>"
    value: int


def _final(value: int) -> str:
    return f"#### {value}"


def _p_add(r: random.Random) -> Problem:
    n, it = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 60), r.randint(2, 60)
    c = a + b
    q = (
        f"{n} has {a} {it}. {n} gets {b} more {it} at {r.choice(PLACES)}. "
        f"How many {it} does {n} have now?"
    )
    ans = f"{n} has {a} + {b} = <<{a}+{b}={c}>>{c} {it} now.\n{_final(c)}"
    return Problem(q, ans, c)


def _p_sub(r: random.Random) -> Problem:
    n, m, it = *r.sample(NAMES, 2), r.choice(ITEMS)
    a = r.randint(10, 90)
    b = r.randint(1, a - 1)
    c = a - b
    q = f"{n} had {a} {it}. {n} gave {b} {it} to {m}. How many {it} does {n} have left?"
    ans = f"{n} has {a} - {b} = <<{a}-{b}={c}>>{c} {it} left.\n{_final(c)}"
    return Problem(q, ans, c)


def _p_mul(r: random.Random) -> Problem:
    n, it, box = r.choice(NAMES), r.choice(ITEMS), r.choice(CONTAINERS)
    a, b = r.randint(2, 12), r.randint(2, 12)
    c = a * b
    q = f"{n} has {a} {box}. Each of the {box} holds {b} {it}. How many {it} does {n} have in all?"
    ans = f"{n} has {a} * {b} = <<{a}*{b}={c}>>{c} {it} in all.\n{_final(c)}"
    return Problem(q, ans, c)


def _p_div(r: random.Random) -> Problem:
    n, it = r.choice(NAMES), r.choice(ITEMS)
    b, c = r.randint(2, 9), r.randint(2, 12)
    a = b * c
    q = f"{n} shares {a} {it} equally among {b} friends. How many {it} does each friend get?"
    ans = f"Each friend gets {a} / {b} = <<{a}/{b}={c}>>{c} {it}.\n{_final(c)}"
    return Problem(q, ans, c)


def _p_price(r: random.Random) -> Problem:
    n, it = r.choice(NAMES), r.choice(ITEMS)
    a, p = r.randint(2, 15), r.randint(2, 9)
    c = a * p
    q = (
        f"{n} buys {a} {it} at {r.choice(PLACES)}. Each one costs ${p}. "
        f"How much money does {n} spend?"
    )
    ans = f"{n} spends {a} * {p} = <<{a}*{p}={c}>>{c} dollars.\n{_final(c)}"
    return Problem(q, ans, c)


def _p_two_step(r: random.Random) -> Problem:
    n, m, it = *r.sample(NAMES, 2), r.choice(ITEMS)
    a, b = r.randint(5, 50), r.randint(2, 40)
    s = a + b
    g = r.randint(1, s - 1)
    c = s - g
    q = (
        f"{n} has {a} {it}. {n} buys {b} more {it}. Then {n} gives {g} {it} to {m}. "
        f"How many {it} does {n} have now?"
    )
    ans = (
        f"After buying, {n} has {a} + {b} = <<{a}+{b}={s}>>{s} {it}.\n"
        f"After giving, {n} has {s} - {g} = <<{s}-{g}={c}>>{c} {it}.\n{_final(c)}"
    )
    return Problem(q, ans, c)


def _p_groups_plus(r: random.Random) -> Problem:
    n, it, box = r.choice(NAMES), r.choice(ITEMS), r.choice(CONTAINERS)
    a, b, e = r.randint(2, 9), r.randint(2, 9), r.randint(1, 20)
    m = a * b
    c = m + e
    q = (
        f"{n} has {a} {box} with {b} {it} in each. {n} also has {e} loose {it}. "
        f"How many {it} does {n} have in total?"
    )
    ans = (
        f"The {box} hold {a} * {b} = <<{a}*{b}={m}>>{m} {it}.\n"
        f"In total {n} has {m} + {e} = <<{m}+{e}={c}>>{c} {it}.\n{_final(c)}"
    )
    return Problem(q, ans, c)


def _p_compare(r: random.Random) -> Problem:
    n, m, it = *r.sample(NAMES, 2), r.choice(ITEMS)
    a, d = r.randint(3, 40), r.randint(2, 30)
    b = a + d
    c = a + b
    q = f"{n} has {a} {it}. {m} has {d} more {it} than {n}. How many {it} do they have together?"
    ans = (
        f"{m} has {a} + {d} = <<{a}+{d}={b}>>{b} {it}.\n"
        f"Together they have {a} + {b} = <<{a}+{b}={c}>>{c} {it}.\n{_final(c)}"
    )
    return Problem(q, ans, c)


GENERATORS = [_p_add, _p_sub, _p_mul, _p_div, _p_price, _p_two_step, _p_groups_plus, _p_compare]


def problem_stream(seed: int) -> Iterator[Problem]:
    """Endless deterministic stream of problems for ``seed``."""
    r = random.Random(seed)
    while True:
        yield r.choice(GENERATORS)(r)


def heldout_problems(n: int = DEFAULT_HELDOUT_SIZE) -> list[Problem]:
    """The first ``n`` distinct problems of the held-out stream."""
    out: list[Problem] = []
    seen: set[str] = set()
    for p in problem_stream(HELDOUT_SEED):
        if p.question in seen:
            continue
        seen.add(p.question)
        out.append(p)
        if len(out) == n:
            return out
    raise AssertionError("unreachable")


def train_problems(n: int, heldout_size: int = DEFAULT_HELDOUT_SIZE) -> list[Problem]:
    """``n`` training problems; questions of the held-out set are skipped."""
    banned = {p.question for p in heldout_problems(heldout_size)}
    out: list[Problem] = []
    for p in problem_stream(TRAIN_SEED):
        if p.question in banned:
            continue
        out.append(p)
        if len(out) == n:
            return out
    raise AssertionError("unreachable")


PROMPT_PREFIX = "Question: "
ANSWER_PREFIX = "\nAnswer:"


def format_prompt(question: str) -> str:
    """The prompt the model is trained to continue (also the zero-shot eval prompt)."""
    return f"{PROMPT_PREFIX}{question}{ANSWER_PREFIX}"


def format_document(p: Problem) -> str:
    """One training document (the trainer appends the end-of-text token). The answer starts with a
    space so that the prompt, which ends at ``Answer:``, tokenizes the same alone and inside it."""
    return format_prompt(p.question) + " " + p.answer


def write_gsm8k_jsonl(path: str, problems: list[Problem]) -> None:
    """GSM8K-format JSONL: one ``{"question": ..., "answer": ...}`` object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps({"question": p.question, "answer": p.answer}) + "\n")
