"""Text of a request's output as its tokens arrive: incremental decoding and stop strings.

A token may end inside a character (byte-level tokenizers split UTF-8 characters), and some
decoders treat the first token of a sequence differently (sentencepiece drops a leading space).
So the text of new tokens is decoded with a few tokens before them for context,

    new text = decode(ids[prefix:]) minus decode(ids[prefix:read])

and held back while it ends in U+FFFD (an unfinished character). The pieces handed out, joined,
are the text of the whole output, so a streamed answer equals the one-piece answer.

Stop strings: the text ends just before the first occurrence of any of them; while streaming, the
last (longest stop - 1) characters stay unsent, since they may be the start of one.
"""

from __future__ import annotations

from collections.abc import Sequence

from trireme.data.tokenizer_base import Tokenizer

UNFINISHED = "\ufffd"


class TextStream:
    """The output text of one request (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] are decoded only for context
        self.read = 0  # ids[read:] have not been turned into text yet
        self.text = ""  # the text so far (ends before a stop string once one is found)
        self.sent = 0  # characters of `text` handed out
        self.stopped = False

    def add(self, token: int) -> None:
        """One more output token; sets `stopped` when the text reaches a stop string."""
        if self.stopped:
            return
        self.ids.append(token)
        context = self.tokenizer.decode(self.ids[self.prefix : self.read])
        full = self.tokenizer.decode(self.ids[self.prefix :])
        if full.endswith(UNFINISHED) or not full.startswith(context):
            return  # wait for the rest of the character
        self._extend(full[len(context):])
        self.prefix, self.read = self.read, len(self.ids)

    def finish(self) -> None:
        """The output is complete: whatever is still held back becomes text."""
        if not self.stopped and self.read < len(self.ids):
            context = self.tokenizer.decode(self.ids[self.prefix : self.read])
            full = self.tokenizer.decode(self.ids[self.prefix :])
            self._extend(full[len(context):] if full.startswith(context) else full)
            self.read = len(self.ids)
        self.stopped = True

    def _extend(self, piece: str) -> None:
        start = max(len(self.text) - self.hold, 0)  # a stop string may straddle the old end
        self.text += piece
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def delta(self) -> str:
        """The text not handed out yet that is safe to hand out now."""
        end = len(self.text) if self.stopped else max(len(self.text) - self.hold, self.sent)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece


def encodable(text: str) -> bool:
    """Whether `text` is valid Unicode (JSON's escapes can carry a lone surrogate, "\\udfff",
    which no tokenizer or file takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
