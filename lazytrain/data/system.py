"""``--system-prompt``: the system turn put first in every chat that has none.

``--system-prompt TEXT`` is that turn.  ``--system-prompt ''`` asks for none, which a chat template may not allow:
SmolLM2's writes a default ("You are a helpful AI assistant named SmolLM, trained by Hugging Face") into every
chat whose first turn is not a system turn, and writes a system block for an empty one.  What the template does is
found by rendering it (a marker in each turn, the renderings compared from their ends):

- it adds nothing to a chat without a system turn: no turn is added (nothing to leave out);
- it adds a default, and an empty system turn renders as nothing: an empty system turn is added (the default is
  left out, and no block written);
- it adds a default, and renders an empty system turn as an empty block: an empty system turn is added (the
  default's words are left out) and a note says the template still writes the empty block, and that a
  ``--chat-template FILE`` without the default leaves it out whole.
"""

from __future__ import annotations

_MARK = "lazytrain-marker-\u2603"


def system_turn(enc, text: str) -> tuple[str, str] | None:
    """The turn ``enc`` (an ``Encoder`` with a chat template) puts first for ``--system-prompt text``."""
    if text:
        return ("system", text)
    turns = (("user", _MARK + "u"), ("assistant", _MARK + "a"))
    bare = enc.render(turns, "--system-prompt ''")
    marked = enc.render((("system", _MARK + "s"), *turns), "--system-prompt ''")
    head = _head(bare, marked)
    if not head or _head(marked, bare).startswith(head):
        return None                  # the template adds nothing where there is no system turn
    empty = enc.render((("system", ""), *turns), "--system-prompt ''")
    block = _head(empty, bare)
    if block:
        print(f"note: {enc.name}'s chat template writes a default system prompt into a chat without a system turn, "
              f"and a system block even for an empty one: with --system-prompt '' each chat gets an empty system "
              f"turn (the default's words left out, the template's empty block {block!r} kept); to leave the block "
              f"out too, give --chat-template FILE with a template that writes no default")
    return ("system", "")


def _head(text: str, other: str) -> str:
    """``text`` less the longest end it shares with ``other``."""
    n = 0
    while n < min(len(text), len(other)) and text[-1 - n] == other[-1 - n]:
        n += 1
    return text[:len(text) - n]
