"""Renderers: exact token layouts, loss weights on assistant tokens only, generation prompts.

No Qwen3 tokenizer is available offline here, so the qwen3 format is checked by its exact text
(Qwen3's chat template output, written out by hand below) and token layout, not against
`apply_chat_template` of a downloaded tokenizer. The "letters" vocabulary has one token per
character (and one per special token), so a weight list can be written down from the text.
"""

from __future__ import annotations

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import models

from temper.tokenizer import Tokenizer, build_builtin_tokenizer, load_tokenizer
from temper.tokenizer.renderers import RENDERER_NAMES, build_renderer
from tests.tokenizer.test_tokenizer import write_qwen3_like_dir

LETTERS = build_builtin_tokenizer("letters")
EOS = "<|im_end|>"


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def layout(*pieces: tuple[str, float]) -> tuple[str, list[float]]:
    """Text and per-token weights for the letters vocabulary (one token per char or marker)."""
    text, weights = "", []
    for piece, weight in pieces:
        text += piece
        num_tokens = len(LETTERS.encode(piece))
        weights += [weight] * num_tokens
    return text, weights


def test_role_colon_layout_and_weights_are_exact():
    messages = [
        {"role": "system", "content": "Be brief."},
        user("Hi"),
        assistant("Yo"),
        user("Sky?"),
        assistant("Blue."),
    ]
    rendered = build_renderer("role_colon", tokenizer=LETTERS).render(messages)
    text, weights = layout(
        ("System: Be brief.\n\nUser: Hi\n\nAssistant:", 0.0),
        (" Yo" + EOS, 1.0),
        ("\n\nUser: Sky?\n\nAssistant:", 0.0),
        (" Blue." + EOS, 1.0),
        ("\n\n", 0.0),
    )
    assert LETTERS.decode(rendered.tokens) == text
    assert rendered.weights == weights
    assert rendered.num_weighted == len(" Yo") + len(" Blue.") + 2


def test_last_assistant_only_weights_the_final_reply():
    messages = [user("a"), assistant("b"), user("c"), assistant("d")]
    renderer = build_renderer("role_colon", tokenizer=LETTERS)
    rendered = renderer.render(messages, train_on="last_assistant")
    trained = [t for t, w in zip(rendered.tokens, rendered.weights, strict=True) if w]
    assert LETTERS.decode(trained) == " d" + EOS


def test_role_colon_prompt_stop_and_parse():
    renderer = build_renderer("role_colon", tokenizer=LETTERS)
    prompt = renderer.generation_prompt([user("Hi")])
    assert LETTERS.decode(prompt) == "User: Hi\n\nAssistant:"
    assert renderer.stop == ["\n\nUser:"]
    assert renderer.parse_response(LETTERS.encode(" Hello" + EOS + "junk")) == "Hello"
    assert renderer.parse_response(LETTERS.encode(" Hi\n\nUser: more")) == "Hi"


def test_qwen3_layout_and_weights_are_exact():
    messages = [
        {"role": "system", "content": "S"},
        user("Q1"),
        assistant("<think>old</think>A1"),
        user("Q2"),
        assistant("A2"),
    ]
    rendered = build_renderer("qwen3", tokenizer=LETTERS).render(messages)
    text, weights = layout(
        ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n", 0.0),
        ("<|im_start|>assistant\n", 0.0),
        ("A1<|im_end|>", 1.0),  # reasoning of a turn before the last user message is dropped
        ("\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n", 0.0),
        ("<think>\n\n</think>\n\nA2<|im_end|>", 1.0),  # the reply writes its (empty) block
        ("\n", 0.0),
    )
    assert LETTERS.decode(rendered.tokens) == text
    assert rendered.weights == weights


def test_qwen3_no_think_puts_the_empty_block_in_the_prompt():
    messages = [user("Q"), assistant("A")]
    renderer = build_renderer("qwen3_no_think", tokenizer=LETTERS)
    text, weights = layout(
        ("<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0.0),
        ("A<|im_end|>", 1.0),
        ("\n", 0.0),
    )
    rendered = renderer.render(messages)
    assert LETTERS.decode(rendered.tokens) == text
    assert rendered.weights == weights
    prompt = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert LETTERS.decode(renderer.generation_prompt([user("Q")])) == prompt
    assert LETTERS.decode(build_renderer("qwen3", tokenizer=LETTERS).generation_prompt(
        [user("Q")]
    )) == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"  # fmt: skip


def test_qwen3_keeps_and_trains_the_reasoning_of_the_last_reply():
    rendered = build_renderer("qwen3", tokenizer=LETTERS).render(
        [user("Q"), assistant("<think>\nplan\n</think>\n\nA")]
    )
    trained = [t for t, w in zip(rendered.tokens, rendered.weights, strict=True) if w]
    assert LETTERS.decode(trained) == "<think>\nplan\n</think>\n\nA<|im_end|>"
    with pytest.raises(ValueError, match=r"message 1: renderer 'qwen3_no_think'.*<think>"):
        build_renderer("qwen3_no_think", tokenizer=LETTERS).render(
            [user("Q"), assistant("<think>plan</think>A")]
        )


def test_qwen3_on_a_byte_level_bpe_tokenizer(tmp_path):
    tokenizer = load_tokenizer(write_qwen3_like_dir(tmp_path / "qwen3"))
    renderer = build_renderer("qwen3", tokenizer=tokenizer)
    rendered = renderer.render([user("What is 12 + 30?"), assistant("42")])
    expected = (
        "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n42<|im_end|>\n"
    )
    assert tokenizer.decode(rendered.tokens) == expected
    trained = [t for t, w in zip(rendered.tokens, rendered.weights, strict=True) if w]
    assert tokenizer.decode(trained) == "<think>\n\n</think>\n\n42<|im_end|>"
    assert renderer.stop == [tokenizer.token_to_id("<|im_end|>")]
    assert renderer.parse_response([*tokenizer.encode("42"), renderer.stop[0], 5]) == "42"


TEXT = st.text(alphabet="ab <>/\n", max_size=6)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(RENDERER_NAMES),
    history=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), TEXT), max_size=4),
    question=TEXT,
    reply=st.text(alphabet="ab \n", max_size=6),
)
def test_generation_prompt_is_the_prefix_before_the_trained_reply(name, history, question, reply):
    """Training and sampling agree: the rendered conversation is the generation prompt of its
    history, then exactly the weighted reply tokens, then untrained separators."""
    renderer = build_renderer(name, tokenizer=LETTERS)
    messages = [{"role": role, "content": text} for role, text in history]
    messages += [user(question)]
    try:
        rendered = renderer.render([*messages, assistant(reply)], train_on="last_assistant")
    except ValueError:
        assert name == "qwen3_no_think"  # a history reply with reasoning after the last user
        return
    prompt = renderer.generation_prompt(messages)
    assert rendered.tokens[: len(prompt)] == prompt
    assert not any(rendered.weights[: len(prompt)])
    rest = rendered.weights[len(prompt) :]
    num_trained = sum(1 for w in rest if w)
    assert rest[:num_trained] == [1.0] * num_trained and not any(rest[num_trained:])
    trained_text = LETTERS.decode(rendered.tokens[len(prompt) : len(prompt) + num_trained])
    response = renderer.parse_response(LETTERS.encode(trained_text))
    # qwen3 (thinking on) replies carry their think block, empty here.
    assert response.split("</think>")[-1].strip() == reply.strip()


def test_bad_messages_and_names_are_errors():
    renderer = build_renderer("role_colon", tokenizer=LETTERS)
    with pytest.raises(ValueError, match=r"message 1: role 'tool' is not one of"):
        renderer.render([user("a"), {"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="message 0: content must be a string, got int"):
        renderer.render([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="unknown renderer 'chatml'; valid renderers"):
        build_renderer("chatml", tokenizer=LETTERS)


def test_qwen3_needs_the_chatml_markers():
    backend = tokenizers.Tokenizer(models.WordLevel({"a": 0, "<eos>": 1}, unk_token=None))
    backend.add_special_tokens([tokenizers.AddedToken("<eos>", special=True)])
    plain = Tokenizer(backend, config={"eos_token": "<eos>"}, name_or_path="plain")
    with pytest.raises(ValueError, match=r"needs the token '<\|im_start\|>'.*'plain'"):
        build_renderer("qwen3", tokenizer=plain)
    rendered = build_renderer("role_colon", tokenizer=build_builtin_tokenizer("words")).render(
        [user("What is two plus two?"), assistant("Four.")]
    )
    assert rendered.num_weighted == len(build_builtin_tokenizer("words").encode(" Four.")) + 1


def test_role_colon_chat_template_writes_what_the_renderer_renders(tmp_path):
    from transformers import AutoTokenizer

    bytes_tokenizer = build_builtin_tokenizer("bytes")
    bytes_tokenizer.save(tmp_path)
    renderer = build_renderer("role_colon", tokenizer=bytes_tokenizer)
    Tokenizer.replace_chat_template(tmp_path, renderer.chat_template)
    reference = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    messages = [
        {"role": "system", "content": "Be brief."},
        user("Où est le ciel?"),
        assistant("En haut."),
        user("Et ensuite?"),
    ]
    prompt = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert bytes_tokenizer.encode(prompt) == renderer.generation_prompt(messages)
    whole = [*messages, assistant("Rien.")]
    text = reference.apply_chat_template(whole, tokenize=False)
    assert bytes_tokenizer.encode(text) == renderer.render(whole).tokens
    assert load_tokenizer(tmp_path).chat_template == renderer.chat_template
