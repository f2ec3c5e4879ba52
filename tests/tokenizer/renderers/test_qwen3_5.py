"""The qwen3_5 renderers equal tinker-cookbook 0.6.1's, token for token, on a tokenizer with
Qwen3.5's special tokens at their real ids (tests/tokenizer/qwen3_5_tokenizer.py, local).

Conversations are written in the cookbook's form (thinking as parts, `ToolCall` objects) and
turned into Temper's (reasoning inline as `<think>...</think>`, calls as HF chat-template
dicts) by `to_temper`; both renderers then render them, build generation prompts at every
assistant turn, and parse the same sampled completions.
"""

from __future__ import annotations

import json

import pytest
import tokenizers

from temper.tokenizer import load_tokenizer
from temper.tokenizer.renderers import build_renderer, default_renderer
from tests.tokenizer.qwen3_5_tokenizer import QWEN3_5_IDS, write_qwen3_5_like_dir

NOT_INSTALLED = "tinker-cookbook is not installed (`make test` installs it: see the Makefile)"
cookbook = pytest.importorskip("tinker_cookbook.renderers", reason=NOT_INSTALLED)
cookbook_base = pytest.importorskip("tinker_cookbook.renderers.base", reason=NOT_INSTALLED)
transformers = pytest.importorskip("transformers")

ToolCall = cookbook_base.ToolCall
TrainOnWhat = cookbook_base.TrainOnWhat
NAMES = ["qwen3_5", "qwen3_5_disable_thinking", "qwen3_5_preserve_thinking"]
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city, caf\u00e9 districts included.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
    {"name": "get_time", "description": "The time now.", "parameters": {"type": "object"}},
]


def call(name: str, **arguments) -> object:
    return ToolCall(function=ToolCall.FunctionBody(name=name, arguments=json.dumps(arguments)))


def thinking(text: str) -> dict:
    return {"type": "thinking", "thinking": text}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def to_temper(message: dict) -> dict:
    """A cookbook message in Temper's form."""
    content = message["content"]
    if not isinstance(content, str):
        content = "".join(
            f"<think>{p['thinking']}</think>" if p["type"] == "thinking" else p["text"]
            for p in content
        )
    converted = {"role": message["role"], "content": content}
    if message.get("tool_calls"):
        converted["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": json.loads(c.function.arguments),
                },
            }
            for c in message["tool_calls"]
        ]
    return converted


def tool_conversation() -> list[dict]:
    weather = call("get_weather", city="Paris", days=2, hourly=True, units=None, ratio=1.5)
    nested = call("get_weather", city="Lyon", where={"lat": 45.7, "tags": ["old", "\u00e9"]})
    return [
        {"role": "system", "content": "unused"},  # replaced by the tools prompt below
        {"role": "user", "content": "  Weather in Paris and Lyon?\n"},
        {
            "role": "assistant",
            "content": [thinking("Two cities: two calls."), text("Checking both.")],
            "tool_calls": [weather, nested],
        },
        {"role": "tool", "content": '{"city": "Paris", "c": 21}'},
        {"role": "tool", "content": '{"city": "Lyon", "c": 23}'},
        {
            "role": "assistant",
            "content": [thinking("Also the time."), text("")],
            "tool_calls": [call("get_time")],
        },
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": [thinking("Both are mild."), text("21 and 23 C.")]},
    ]


CONVERSATIONS = {
    "history_thinking": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": [thinking("2+2 is 4."), text("4")]},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": [thinking("Add: 6."), text("\n\n6 ")]},
    ],
    "no_reasoning": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye\n\n"},
        {"role": "assistant", "content": "  Bye."},
    ],
    "interleaved_thinking": [
        {"role": "user", "content": "Plan, then answer."},
        {
            "role": "assistant",
            "content": [thinking("first"), text("Step one. "), thinking("second"), text("Done.")],
        },
    ],
    "no_user": [
        {"role": "system", "content": "Talk."},
        {"role": "assistant", "content": "Hello there."},
    ],
    "tools": tool_conversation(),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_qwen3_5_like_dir(tmp_path_factory.mktemp("qwen3_5_tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    # The directory's tokenizer.json wrapped as is (from_pretrained takes seconds over 248k ids).
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def pair(tokenizer, hf_tokenizer):
    """name -> (Temper's renderer, the cookbook's)."""
    return {
        name: (
            build_renderer(name, tokenizer=tokenizer),
            cookbook.get_renderer(name, hf_tokenizer, model_name="qwen3_5-test"),
        )
        for name in NAMES
    }


def with_tools_prompt(messages: list[dict], reference) -> list[dict]:
    if messages[0]["content"] != "unused":
        return messages
    system = reference.create_conversation_prefix_with_tools(TOOLS, "Be exact.")
    return [*system, *messages[1:]]


def has_reasoning(message: dict) -> bool:
    return not isinstance(message["content"], str) and any(
        p["type"] == "thinking" for p in message["content"]
    )


def test_the_tokenizer_has_qwen3_5_ids(tokenizer, pair):
    assert tokenizer.vocab_size == 248077 and tokenizer.eos_token_id == 248046
    for token in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>"):
        assert tokenizer.token_to_id(token) == QWEN3_5_IDS[token]
    assert (QWEN3_5_IDS["<|im_start|>"], QWEN3_5_IDS["<think>"]) == (248045, 248068)
    renderer, reference = pair["qwen3_5"]
    prompt = renderer.generation_prompt([{"role": "user", "content": "Hi"}])
    assert prompt[-3:] == [tokenizer.encode("assistant\n")[-1], 248068, 198][-3:]
    assert tokenizer.decode(prompt).endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert renderer.stop == reference.get_stop_sequences() == [248046]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_generation_prompts_equal_the_cookbook(pair, name, conversation):
    renderer, reference = pair[name]
    messages = with_tools_prompt(CONVERSATIONS[conversation], reference)
    ends = [i for i, m in enumerate(messages) if m["role"] == "assistant"] + [len(messages)]
    for end in ends:
        history = messages[:end]
        expected = reference.build_generation_prompt(history).to_ints()
        assert renderer.generation_prompt([to_temper(m) for m in history]) == expected, end


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_training_tokens_and_weights_equal_the_cookbook(pair, name, conversation):
    renderer, reference = pair[name]
    messages = with_tools_prompt(CONVERSATIONS[conversation], reference)
    ours = [to_temper(m) for m in messages]
    refuses = name == "qwen3_5_disable_thinking" and has_reasoning(messages[-1])
    if refuses:  # the prompt closed the think block; the reply reasons anyway
        with pytest.raises(Exception, match="thinking"):
            reference.build_supervised_example(messages, TrainOnWhat.LAST_ASSISTANT_MESSAGE)
        with pytest.raises(ValueError, match=r"message \d+: renderer 'qwen3_5_disable_thinking'"):
            renderer.render(ours, train_on="last_assistant")
        return
    model_input, weights = reference.build_supervised_example(
        messages, TrainOnWhat.LAST_ASSISTANT_MESSAGE
    )
    rendered = renderer.render(ours, train_on="last_assistant")
    assert rendered.tokens == model_input.to_ints()
    assert rendered.weights == weights.tolist()

    # all_assistant: the cookbook's tokens; its weights but for the last reply's prefill,
    # which the generation prompt gives and is never trained here.
    model_input, weights = reference.build_supervised_example(
        messages, TrainOnWhat.ALL_ASSISTANT_MESSAGES
    )
    rendered = renderer.render(ours, train_on="all_assistant")
    assert rendered.tokens == model_input.to_ints()
    expected = weights.tolist()
    prompt = reference.build_generation_prompt(messages[:-1]).to_ints()
    if model_input.to_ints()[: len(prompt)] == prompt:
        prefix = f"\n<|im_start|>assistant\n{renderer.prefill}"
        start = len(prompt) - len(reference.tokenizer.encode(prefix, add_special_tokens=False))
        expected[start : len(prompt)] = [0.0] * (len(prompt) - start)
    assert rendered.weights == expected


def test_only_the_last_reply_keeps_its_reasoning(tokenizer, pair):
    renderer = pair["qwen3_5"][0]
    messages = [to_temper(m) for m in CONVERSATIONS["history_thinking"]]
    rendered = renderer.render(messages, train_on="all_assistant")
    text = tokenizer.decode(rendered.tokens)
    assert "2+2 is 4." not in text
    assert text.endswith("<|im_start|>assistant\n<think>\nAdd: 6.\n</think>\n\n6<|im_end|>")
    trained = [t for t, w in zip(rendered.tokens, rendered.weights, strict=True) if w]
    assert tokenizer.decode(trained) == "4<|im_end|>Add: 6.\n</think>\n\n6<|im_end|>"
    kept = pair["qwen3_5_preserve_thinking"][0].render(messages, train_on="all_assistant")
    assert "<think>\n2+2 is 4.\n</think>\n\n4" in tokenizer.decode(kept.tokens)


SAMPLED = {
    "reasoning": "Two and two.\n</think>\n\nThe sum is 4.<|im_end|>",
    "empty_reasoning": "\n</think>\n\nHi!<|im_end|>",
    "no_think_block": "Plain answer.<|im_end|>",
    "xml_calls": (
        "Need the weather.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
        '<parameter=where>\n{"lat": 1.5}\n</parameter>\n</function>\n</tool_call>\n'
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call><|im_end|>"
    ),
    "json_call": (
        '\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>'
    ),
    "broken_call": (
        "x\n</think>\n\n<tool_call>\n<function=f>\nstray\n</function>\n</tool_call><|im_end|>"
    ),
    "unterminated_call": "x\n</think>\n\nok <tool_call>\n<function=f>\n<|im_end|>",
    "cut_off": "Still thinking about it",
}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("sample", list(SAMPLED))
def test_parse_equals_the_cookbook(tokenizer, pair, name, sample):
    renderer, reference = pair[name]
    tokens = tokenizer.encode(SAMPLED[sample])
    expected, termination = reference.parse_response(tokens)
    parsed = renderer.parse_message(tokens)
    assert parsed.complete == (termination == cookbook_base.ParseTermination.STOP_SEQUENCE)
    assert parsed.message == to_temper(expected)
    assert [u.text for u in parsed.unparsed_tool_calls] == [
        u.raw_text for u in expected.get("unparsed_tool_calls", [])
    ]
    assert renderer.parse_response(tokens) == parsed.message["content"]
    if not parsed.complete:
        return
    # The parsed reply goes back into the history the same way on both sides.
    history = [{"role": "user", "content": "Go."}, expected, {"role": "tool", "content": "ok"}]
    assert renderer.generation_prompt([to_temper(m) for m in history]) == (
        reference.build_generation_prompt(history).to_ints()
    )


def test_parsed_tool_calls_and_reasoning(tokenizer, pair):
    parsed = pair["qwen3_5"][0].parse_message(tokenizer.encode(SAMPLED["xml_calls"]))
    assert parsed.message == {
        "role": "assistant",
        "content": "<think>Need the weather.</think>Checking.\n\n\n",  # text around calls
        "tool_calls": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": {"city": "Paris", "days": 2, "where": {"lat": 1.5}},
                },
            },
            {"type": "function", "function": {"name": "get_time", "arguments": {}}},
        ],
    }
    broken = pair["qwen3_5"][0].parse_message(tokenizer.encode(SAMPLED["unterminated_call"]))
    assert "tool_calls" not in broken.message
    assert broken.unparsed_tool_calls[0].error.startswith("unterminated tool call")


def test_tools_system_message_equals_the_cookbook(pair):
    renderer, reference = pair["qwen3_5"]
    for system_prompt in ("", "Be exact."):
        expected = reference.create_conversation_prefix_with_tools(TOOLS, system_prompt)[0]
        assert renderer.tools_system_message(TOOLS, system_prompt=system_prompt) == expected
    assert renderer.tools_system_message([], system_prompt="S")["content"] == "S"


def test_bad_messages_are_errors_naming_the_message(pair):
    renderer = pair["qwen3_5"][0]
    user = {"role": "user", "content": "Q"}
    with pytest.raises(ValueError, match=r"message 1: role 'developer' is not one of"):
        renderer.render([user, {"role": "developer", "content": "x"}])
    with pytest.raises(ValueError, match="message 0: only assistant messages have tool_calls"):
        renderer.generation_prompt([{**user, "tool_calls": [{"function": {"name": "f"}}]}])
    bad_call = {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}
    with pytest.raises(ValueError, match=r"message 1: tool call 0 must be \{\"type\""):
        renderer.render([user, bad_call])
    bad_json = {"function": {"name": "f", "arguments": "{oops"}}
    with pytest.raises(ValueError, match="message 1: tool call 0: arguments are not valid JSON"):
        renderer.render([user, {"role": "assistant", "content": "", "tool_calls": [bad_json]}])
    with pytest.raises(ValueError, match=r"the reply holds 2 <\|im_end\|> tokens"):
        renderer.parse_message([248046, 248046])


def test_default_renderer_for_qwen3_5_models():
    for model in ("Qwen/Qwen3.5-4B", "Qwen/Qwen3.5-397B-A17B", "Qwen/Qwen3.6-35B-A3B"):
        assert default_renderer(model) == "qwen3_5"
    assert default_renderer("qwen3_5") == default_renderer("qwen3_5_moe") == "qwen3_5"
    assert default_renderer("Qwen/Qwen3-8B") == default_renderer("qwen3_moe") == "qwen3"
    assert default_renderer("Qwen/Qwen3.5-9B-Base") == "role_colon"
    assert default_renderer("meta-llama/Llama-3.1-8B") == "role_colon"
