"""Write data/conversations_sample.jsonl: short templated conversations for the SFT demo.

Every text uses only words of the built-in "words" vocabulary (checked here), so a tiny model
with `tiny:words` learns from it without unknown tokens. The templates have rules a small model
can pick up and apply to held-out conversations (counting, adding, repeating a word, recalling
what the user said two turns earlier, yes/no comparisons) plus a few memorized facts.

    .venv/bin/python data/make_conversations_sample.py   # rewrites the file; seeded, so stable
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from temper.tokenizer import build_builtin_tokenizer

OUT_FILE = Path(__file__).with_name("conversations_sample.jsonl")
# fmt: off
NUMBERS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
]
# fmt: on
ANIMALS = ["bird", "cat", "cow", "dog", "fish", "horse"]
THINGS = ["book", "boat", "box", "car", "cup", "hat", "bed", "tree"]
PAIRS = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("good", "bad"), ("up", "down"),
    ("left", "right"), ("open", "close"), ("black", "white"), ("high", "low"), ("near", "far"),
    ("long", "short"), ("yes", "no"), ("day", "night"), ("in", "out"), ("on", "off"),
]  # fmt: skip
COLORS = {
    "sun": "yellow", "sea": "blue", "water": "blue", "tree": "green", "fire": "red",
    "night": "black", "paper": "white", "bread": "brown", "plant": "green", "egg": "white",
}  # fmt: skip
REPEAT_WORDS = ["cat", "dog", "red", "blue", "sun", "hat", "run", "big", "yes", "go", "fish"]
SYSTEM_YES_NO = "Answer with yes or no."


def cap(text: str) -> str:
    return text[0].upper() + text[1:]


def turns(*pairs: tuple[str, str], system: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in pairs:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return messages


def after(rng: random.Random) -> list[dict[str, str]]:
    n = rng.randrange(len(NUMBERS) - 1)
    return turns((f"What is after {NUMBERS[n]}?", f"{cap(NUMBERS[n + 1])} is after {NUMBERS[n]}."))


def plus(rng: random.Random) -> list[dict[str, str]]:
    a = rng.randrange(11)
    b = rng.randrange(11 - a if a < 11 else 1)
    question = f"What is {NUMBERS[a]} plus {NUMBERS[b]}?"
    return turns((question, f"{cap(NUMBERS[a])} plus {NUMBERS[b]} is {NUMBERS[a + b]}."))


def repeat(rng: random.Random) -> list[dict[str, str]]:
    word, times = rng.choice(REPEAT_WORDS), rng.randint(2, 4)
    reply = cap(" ".join([word] * times)) + "."
    return turns((f"Say {word} {NUMBERS[times]} times.", reply))


def pair(rng: random.Random) -> list[dict[str, str]]:
    first, second = rng.choice(PAIRS)
    if rng.random() < 0.5:
        first, second = second, first
    question = f"What is the other word for {first}?"
    return turns((question, f"{cap(second)} is the other word for {first}."))


def color(rng: random.Random) -> list[dict[str, str]]:
    thing = rng.choice(sorted(COLORS))
    return turns((f"What color is the {thing}?", f"The {thing} is {COLORS[thing]}."))


def recall(rng: random.Random) -> list[dict[str, str]]:
    owned = rng.choice(ANIMALS + THINGS)
    article = "an" if owned[0] in "aeiou" else "a"
    return turns(
        (f"I have {article} {owned}.", f"You have {article} {owned}. That is good."),
        ("What do I have?", f"You have {article} {owned}."),
    )


def compare(rng: random.Random) -> list[dict[str, str]]:
    a, b = rng.sample(range(len(NUMBERS)), 2)
    answer = "Yes." if a > b else "No."
    return turns((f"Is {NUMBERS[a]} more than {NUMBERS[b]}?", answer), system=SYSTEM_YES_NO)


TEMPLATES = (after, plus, repeat, pair, color, recall, compare)


def conversations(*, count: int, seed: int) -> list[list[dict[str, str]]]:
    """`count` distinct conversations, drawn round-robin over the templates."""
    rng = random.Random(seed)
    found: dict[str, list[dict[str, str]]] = {}
    attempts = 0
    while len(found) < count:
        messages = TEMPLATES[attempts % len(TEMPLATES)](rng)
        found.setdefault(json.dumps(messages), messages)
        attempts += 1
        assert attempts < 100 * count, "the templates cannot make that many distinct conversations"
    return list(found.values())


def check_vocabulary(records: list[list[dict[str, str]]]) -> None:
    tokenizer = build_builtin_tokenizer("words")
    for messages in records:
        for message in messages:
            ids = tokenizer.encode(message["content"])
            assert tokenizer.unk_token_id not in ids, f"not in the words vocabulary: {message}"


def main() -> None:
    records = conversations(count=300, seed=0)
    check_vocabulary(records)
    lines = [json.dumps({"messages": messages}) for messages in records]
    OUT_FILE.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} conversations to {OUT_FILE}")


if __name__ == "__main__":
    main()
