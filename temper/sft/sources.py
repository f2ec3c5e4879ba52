"""Where SFT examples come from: a task's problems, or rendered JSONL conversations.

Both sources hand the loop `WeightedTokens` (token ids with a loss weight per token), a fixed
held-out set, and a `DataPosition` of plain ints that restores the stream exactly:
- `TaskSource`: problem i of the training stream is drawn from an RNG seeded by (seed, i), so
  the position is just the number of problems drawn; held-out problems are the task's fixed set.
- `ConversationSource`: the conversations are rendered once, up front (so a text the tokenizer
  cannot encode fails before training), and drawn in seeded epochs (`EpochStream`).
Both also score greedy replies on held-out examples through a sampling client.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from temper.api.types import ModelInput, SamplingParams
from temper.sft.batches import completion_tokens
from temper.sft.datasets import Conversation, ConversationDataset, DataPosition, EpochStream
from temper.tasks.evaluation import greedy_accuracy, heldout_problems
from temper.tasks.problem import Task
from temper.tokenizer.renderers import WeightedTokens, build_renderer


@dataclass(frozen=True)
class Example:
    """A prompt, the model's greedy reply and the reference, for the console."""

    prompt: str
    reply: str
    reference: str
    correct: bool


class TaskSource:
    def __init__(self, task: Task, *, tokenizer, seed: int, num_heldout: int) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.seed = seed
        self.position = DataPosition(epoch=0, index=0)
        self.heldout_problems = heldout_problems(task, count=num_heldout)
        self.heldout = [self._example(problem) for problem in self.heldout_problems]

    def next_batch(self, batch_size: int) -> list[WeightedTokens]:
        start = self.position.index
        problems = [
            self.task.sample(random.Random(f"sft-{self.seed}-{index}"), split="train")
            for index in range(start, start + batch_size)
        ]
        self.position = DataPosition(epoch=0, index=start + batch_size)
        return [self._example(problem) for problem in problems]

    def accuracy(self, sampling_client, *, max_tokens: int, limit: int | None = None):
        """Greedy accuracy on the held-out problems, and the first few as examples."""
        problems = self.heldout_problems[:limit]
        accuracy, scored = greedy_accuracy(
            sampling_client,
            problems,
            task=self.task,
            tokenizer=self.tokenizer,
            max_tokens=max_tokens,
        )
        examples = [
            Example(prompt=prompt, reply=reply, reference=p.answer, correct=reward == 1.0)
            for p, (prompt, reply, reward) in zip(problems, scored, strict=True)
        ]
        return accuracy, examples

    def _example(self, problem) -> WeightedTokens:
        tokenizer = self.tokenizer
        answer = [*tokenizer.encode(problem.answer), tokenizer.eos_token_id]
        return completion_tokens(tokenizer.encode(problem.prompt), answer)


class ConversationSource:
    def __init__(self, dataset: ConversationDataset, *, tokenizer, seed: int) -> None:
        config = dataset.config
        self.renderer_name = config.renderer
        self.renderer = build_renderer(config.renderer, tokenizer=tokenizer)
        self.tokenizer = tokenizer
        self._train_on = config.train_on
        self.train = [self._render(c) for c in dataset.train]
        self.heldout = [self._render(c) for c in dataset.heldout]
        self.heldout_conversations = dataset.heldout
        self._stream = EpochStream(len(self.train), seed=seed)

    @property
    def position(self) -> DataPosition:
        return self._stream.position

    @position.setter
    def position(self, position: DataPosition) -> None:
        self._stream = EpochStream(len(self.train), seed=self._stream.seed, position=position)

    def next_batch(self, batch_size: int) -> list[WeightedTokens]:
        return [self.train[index] for index in self._stream.take(batch_size)]

    def accuracy(self, sampling_client, *, max_tokens: int, limit: int | None = None):
        """Share of held-out conversations whose last assistant message the model reproduces
        exactly (greedy, from the conversation before it), and the first few as examples."""
        conversations = self.heldout_conversations[:limit]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=self.renderer.stop)
        futures, references = [], []
        with sampling_client.batch():  # one batch whatever the timing (tasks/evaluation.py)
            for conversation in conversations:
                messages = list(conversation.messages)
                last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
                prompt = self.renderer.generation_prompt(messages[:last])
                futures.append(sampling_client.sample(ModelInput.from_ints(prompt), 1, params))
                references.append((messages[:last], messages[last]["content"]))
        examples = []
        for future, (history, reference) in zip(futures, references, strict=True):
            reply = self.renderer.parse_response(future.result().sequences[0].tokens)
            examples.append(
                Example(
                    prompt=_last_user_text(history),
                    reply=reply,
                    reference=reference,
                    correct=reply.strip() == reference.strip(),
                )
            )
        return sum(e.correct for e in examples) / len(examples), examples

    def _render(self, conversation: Conversation) -> WeightedTokens:
        try:
            rendered = self.renderer.render(conversation.messages, train_on=self._train_on)
        except ValueError as error:
            raise ValueError(f"{conversation.where}: {error}") from None
        unk = self.tokenizer.unk_token_id
        if unk is not None and unk in rendered.tokens:
            unknown = sorted(
                {
                    piece
                    for message in conversation.messages
                    for piece in self.tokenizer.unknown_pieces(message["content"])
                }
            )
            raise ValueError(
                f"{conversation.where}: tokenizer {self.tokenizer.name_or_path!r} encodes part "
                f"of this conversation as its unknown token (pieces not in the vocabulary: "
                f"{unknown[:20]}); use a tokenizer that covers the text"
            )
        return rendered


def _last_user_text(messages: Sequence) -> str:
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else ""
