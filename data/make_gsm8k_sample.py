"""Writes gsm8k_sample.jsonl: 50 small grade-school word problems in GSM8K's JSONL format.

Generated from templates with seeded random numbers (not taken from GSM8K); each worked
solution computes its answer step by step and ends with `#### <answer>`, as GSM8K's do.

    python data/make_gsm8k_sample.py
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ["Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jon"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "cards", "shells", "stamps"]

Template = Callable[[random.Random], tuple[str, list[str], int]]


def buy_more(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    have, bags, per_bag = rng.randint(3, 40), rng.randint(2, 6), rng.randint(3, 12)
    total = have + bags * per_bag
    question = (
        f"{name} has {have} {item}. {name} buys {bags} bags with {per_bag} {item} in each bag. "
        f"How many {item} does {name} have now?"
    )
    steps = [
        f"The bags hold {bags} * {per_bag} = {bags * per_bag} {item}.",
        f"{name} has {have} + {bags * per_bag} = {total} {item}.",
    ]
    return question, steps, total


def give_away(rng: random.Random) -> tuple[str, list[str], int]:
    name, friend, item = *rng.sample(NAMES, 2), rng.choice(ITEMS)
    given, left = rng.randint(2, 30), rng.randint(1, 50)
    have = given + left
    question = f"{name} had {have} {item} and gave {given} to {friend}. How many {item} are left?"
    return question, [f"{name} has {have} - {given} = {left} {item} left."], left


def share_equally(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 8), rng.randint(2, 15)
    total = friends * each
    question = (
        f"{name} shares {total} {item} equally among {friends} friends. "
        f"How many {item} does each friend get?"
    )
    return question, [f"Each friend gets {total} / {friends} = {each} {item}."], each


def change_from_bill(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    count, price = rng.randint(2, 6), rng.randint(2, 9)
    cost = count * price
    bill = 50 if cost < 50 else 100
    change = bill - cost
    question = (
        f"{name} buys {count} notebooks that cost ${price} each and pays with a ${bill} bill. "
        f"How much change does {name} get, in dollars?"
    )
    steps = [
        f"The notebooks cost {count} * {price} = ${cost}.",
        f"The change is {bill} - {cost} = ${change}.",
    ]
    return question, steps, change


def pages_left(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    per_day, days, left = rng.randint(5, 30), rng.randint(2, 7), rng.randint(10, 120)
    read = per_day * days
    pages = read + left
    question = (
        f"A book has {pages} pages. {name} reads {per_day} pages a day for {days} days. "
        "How many pages are still unread?"
    )
    steps = [
        f"{name} reads {per_day} * {days} = {read} pages.",
        f"{pages} - {read} = {left} pages are unread.",
    ]
    return question, steps, left


def wages(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    rate, hours, days = rng.randint(8, 25), rng.randint(2, 8), rng.randint(2, 6)
    per_day = rate * hours
    total = per_day * days
    question = (
        f"{name} earns ${rate} an hour and works {hours} hours a day for {days} days. "
        f"How many dollars does {name} earn?"
    )
    steps = [
        f"Each day {name} earns {rate} * {hours} = ${per_day}.",
        f"In {days} days {name} earns {per_day} * {days} = ${total}.",
    ]
    return question, steps, total


def ages(rng: random.Random) -> tuple[str, list[str], int]:
    older, younger = rng.sample(NAMES, 2)
    age, gap = rng.randint(5, 40), rng.randint(1, 20)
    total = age + age + gap
    question = (
        f"{younger} is {age} years old. {older} is {gap} years older than {younger}. "
        "What is the sum of their ages?"
    )
    steps = [
        f"{older} is {age} + {gap} = {age + gap} years old.",
        f"Together they are {age} + {age + gap} = {total} years old.",
    ]
    return question, steps, total


def garden(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    rows, per_row = rng.randint(3, 12), rng.randint(4, 15)
    planted = rows * per_row
    died = rng.randint(1, planted - 1)
    alive = planted - died
    question = (
        f"{name} plants {rows} rows of tomatoes with {per_row} plants in each row. "
        f"{died} plants die. How many plants are still alive?"
    )
    steps = [
        f"{name} plants {rows} * {per_row} = {planted} plants.",
        f"{planted} - {died} = {alive} plants are alive.",
    ]
    return question, steps, alive


TEMPLATES: list[Template] = [
    buy_more,
    give_away,
    share_equally,
    change_from_bill,
    pages_left,
    wages,
    ages,
    garden,
]


def main(*, count: int = 50, seed: int = 0) -> None:
    rng = random.Random(seed)
    lines = []
    for index in range(count):
        question, steps, answer = TEMPLATES[index % len(TEMPLATES)](rng)
        solution = "\n".join([*steps, f"#### {answer}"])
        lines.append(json.dumps({"question": question, "answer": solution}))
    out = Path(__file__).with_name("gsm8k_sample.jsonl")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {count} problems to {out}")


if __name__ == "__main__":
    main()
