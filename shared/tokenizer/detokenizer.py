"""Incremental detokenization: turn a stream of generated token ids into a stream of text.

Decoding one token at a time is wrong twice over: a byte-level BPE token can hold part of a UTF-8
character (an emoji spans up to four tokens), and SentencePiece decoders drop the leading space of
the first token they see. So, like vLLM, we decode a small window twice -- the already-emitted
tokens at its start (``prefix``) and the whole window -- and emit the difference, holding it back
while it ends in U+FFFD (an incomplete character that the next token may finish).

Offsets into ``_ids`` (invariant: ``prefix_offset <= read_offset <= len(_ids)``)::

    [ ... done ... | prefix_offset ... read_offset | ... not yet emitted ... ]
                     context for the leading space   text still to come out
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from shared.tokenizer.tokenizer import Tokenizer

# How many prompt tokens to decode as context before the first generated token (vLLM's value).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Per request. ``push`` returns only newly completed text; the concatenation of every ``push``
    plus ``flush`` is the decoded text of all pushed ids (given no prompt context; with a prompt, the
    text is that of the ids as a continuation of the prompt)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, kept_special_ids: Collection[int] = ()):
        """``kept_special_ids``: special tokens kept in the text although the others are skipped
        (a request with tools keeps its format's call markers for the parser, as vLLM does)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._skipped_ids = frozenset(tokenizer.special_token_ids) - frozenset(kept_special_ids) \
            if skip_special_tokens and kept_special_ids else None
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete ("" while a character is unfinished)."""
        self._ids.extend(new_token_ids)
        prefix_text, full_text = self._decode_window()
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(full_text[len(prefix_text):])

    def flush(self) -> str:
        """Return whatever is held back (an unfinished character comes out as U+FFFD). Call once
        when the request ends."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text, full_text = self._decode_window()
        return self._advance(full_text[len(prefix_text):])

    def _decode_window(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset:]
        split = self._read_offset - self._prefix_offset
        decode, skip = self._tokenizer.decode, self._skip_special
        if self._skipped_ids is not None:  # skipped here, the kept ones decoded as any token
            prefix = [i for i in window[:split] if i not in self._skipped_ids]
            return decode(prefix, False), decode(prefix + [i for i in window[split:] if i not in self._skipped_ids],
                                                 False)
        return decode(window[:split], skip), decode(window, skip)

    def _advance(self, text: str) -> str:
        # The emitted tokens become the next window's prefix; older ids are never read again.
        del self._ids[:self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return text
