"""Records -> token ids and labels, with the model's own tokenizer and chat template.

Labels sit at the positions of the ids (the Hugging Face convention; the loss compares
``logits[t]`` with ``labels[t + 1]``) and are ``-100`` where nothing is learned.  By default
(``loss_on="completion"``) only what the model is to write carries a label: the completion and
the eos, or every assistant turn of a chat; ``loss_on="all"`` labels every token.

*Chats are rendered through the chat template, whole.*  A chat model ends an assistant turn with its
template's own end-of-turn text (``<|im_end|>\\n``, ``<|eot_id|>``, ``<end_of_turn>\\n``), which need
not be the tokenizer's eos.  A target made of the reply plus the eos teaches a model to write the
reply and never the end-of-turn, so at inference it does not stop [ledger: chat-template-targets].
So the conversation is rendered as the template renders it, and for each assistant turn ``i`` the
text between ``render(turns[:i], add_generation_prompt=True)`` and ``render(turns[:i + 1])`` (the
reply and whatever the template closes it with) is the target.  The pieces are tokenized one by one,
so the prompt's tokens are exactly those ``prompt_ids`` gives at inference.  A template that does not
render a conversation's beginning as a prefix of the whole (one that rewrites earlier turns) cannot be
split this way and is an error.

Plain records: ``prompt`` tokenized with the tokenizer's special tokens (its bos), then the
``completion`` and the eos; ``text`` is all completion.  An alpaca record is a chat; with a tokenizer
that has no chat template it falls back to the Alpaca prompt (``### Instruction: ... ### Response:``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..frontend.loss_head import IGNORE
from .formats import DataError, Record

LOSS_ON = ("completion", "all")
ALPACA_PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                 "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


@dataclass(frozen=True, slots=True)
class Example:
    """One tokenized example: what is trained on, and what generation is asked and compared with."""

    ids: tuple[int, ...]
    labels: tuple[int, ...]
    prompt_ids: tuple[int, ...]     # what precedes the last reply (empty for plain text: no generation)
    reference: str                  # the last reply / the completion
    where: str

    def __len__(self) -> int:
        return len(self.ids)


class Encoder:
    """Tokenizes records with ``tokenizer`` (a transformers tokenizer).  ``loss_on``: ``completion`` or
    ``all`` (see the module docstring).  ``system_prompt``: a system turn put first in every chat that has none
    (``system.py``; ``""``: no system prompt, the template's default left out where the template allows)."""

    def __init__(self, tokenizer, loss_on: str = "completion", name: str = "the tokenizer",
                 system_prompt: str | None = None):
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
        self.tok, self.loss_on, self.name = tokenizer, loss_on, name
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.eos_id = tokenizer.eos_token_id
        self.system = None
        if system_prompt is not None and self.has_template:
            from .system import system_turn
            self.system = system_turn(self, system_prompt)

    def with_system(self, turns: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        """``turns`` with the system turn first, unless they have one (or none is asked for)."""
        if self.system is None or (turns and turns[0][0] == "system"):
            return turns
        return (self.system, *turns)

    # ---- one record -----------------------------------------------------------------------------------
    def encode(self, rec: Record) -> Example:
        if rec.is_chat and self.has_template:
            return self._chat(rec)
        if rec.is_chat and rec.format != "alpaca":
            raise DataError(f"{rec.where}: chat examples are rendered with the model's chat template, and "
                            f"{self.name} has none; give the folder a tokenizer with a chat_template, or write "
                            f"the examples as prompt/completion")
        prompt, completion = rec.prompt, rec.completion
        if rec.format == "alpaca":
            prompt, completion = ALPACA_PROMPT.format(instruction=rec.messages[0][1]), rec.messages[1][1]
        if rec.format == "text":
            head = self._ids(completion, special=True)
            body: list[int] = []
        else:
            head = self._ids(prompt, special=True)
            body = self._ids(completion)
        tail = [self.eos_id] if self.eos_id is not None else []
        ids = head + body + tail
        if rec.format == "text" or self.loss_on == "all":
            labels = list(ids)
        else:
            labels = [IGNORE] * len(head) + body + tail
        prompt_ids = () if rec.format == "text" else tuple(head)
        return Example(tuple(ids), tuple(labels), prompt_ids, completion, rec.where)

    def _chat(self, rec: Record) -> Example:
        turns = self.with_system(rec.messages)
        full = self.render(turns, rec.where)
        pieces: list[tuple[str, bool]] = []
        done = 0
        for i, (role, _) in enumerate(turns):
            if role != "assistant":
                continue
            before = self.render(turns[:i], rec.where, prompt=True)
            upto = self.render(turns[:i + 1], rec.where)
            if not (upto.startswith(before) and full.startswith(upto) and len(before) >= done):
                raise DataError(f"{rec.where}: {self.name}'s chat template does not render the conversation's "
                                f"beginning as a prefix of the whole, so the assistant turns cannot be found in it; "
                                f"train with --loss-on all, or write the examples as prompt/completion")
            pieces += [(full[done:len(before)], False), (full[len(before):len(upto)], True)]
            done = len(upto)
        pieces.append((full[done:], False))
        ids: list[int] = []
        labels: list[int] = []
        for text, target in pieces:
            part = self._ids(text)
            ids += part
            labels += part if target or self.loss_on == "all" else [IGNORE] * len(part)
        last = max(i for i, (r, _) in enumerate(turns) if r == "assistant")
        prompt_ids = tuple(self._ids(self.render(turns[:last], rec.where, prompt=True)))
        return Example(tuple(ids), tuple(labels), prompt_ids, turns[last][1], rec.where)

    # ---- pieces ---------------------------------------------------------------------------------------
    def render(self, turns, where: str = "", *, prompt: bool = False) -> str:
        """The chat template's text for ``turns`` ((role, content) pairs); ``prompt``: followed by the
        opening of an assistant turn."""
        msgs = [{"role": r, "content": c} for r, c in turns]
        try:
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
        except Exception as e:  # noqa: BLE001 - jinja raises TemplateError, and templates raise what they like
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{where}: {self.name}'s chat template refuses this conversation: {first}") from None

    def _ids(self, text: str, special: bool = False) -> list[int]:
        if not text:
            return list(self.tok(text, add_special_tokens=True).input_ids) if special else []
        return list(self.tok(text, add_special_tokens=special).input_ids)

    def prompt_for(self, turns) -> list[int]:
        """Token ids asking for the next assistant turn after ``turns`` (for generation)."""
        return self._ids(self.render(self.with_system(tuple(turns)), prompt=True))

    def stop_ids(self, generation_config=None) -> list[int]:
        """Tokens that end a reply: the eos, the chat template's end-of-turn token, and the eos ids of the
        model's generation config."""
        out: list[int] = []
        extra = getattr(generation_config, "eos_token_id", None)
        for i in [self.eos_id, self.end_of_turn_id(), *(extra if isinstance(extra, list) else [extra])]:
            if i is not None and i not in out:
                out.append(int(i))
        return out

    def end_of_turn_id(self) -> int | None:
        """The special token the chat template closes an assistant turn with, or None (no template, or
        it closes turns with plain text)."""
        if not self.has_template:
            return None
        marker = "lazytrain-reply"
        try:
            text = self.render((("user", "hi"), ("assistant", marker)))
        except DataError:
            return None
        after = text[text.rfind(marker) + len(marker):]
        ids = self._ids(after)
        if not ids:
            return None
        special = set(self.tok.all_special_ids) | {i for i, t in self.tok.added_tokens_decoder.items() if t.special}
        return ids[0] if ids[0] in special else None


def fit(ex: Example, seq_len: int, mode: str) -> Example | None:
    """``ex`` if it fits ``seq_len`` tokens; else cut to ``seq_len`` (``mode="truncate"``) or None
    (``"drop"``).  A cut example with no label left is None too: it has nothing to learn."""
    if len(ex) <= seq_len:
        return ex
    if mode == "drop":
        return None
    if mode != "truncate":
        raise ValueError(f"truncate mode must be truncate or drop, got {mode!r}")
    labels = ex.labels[:seq_len]
    if all(v == IGNORE for v in labels[1:]):
        return None
    return Example(ex.ids[:seq_len], labels, ex.prompt_ids, ex.reference, ex.where)
