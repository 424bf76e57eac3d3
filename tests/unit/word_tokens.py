"""A word-level tokenizer for the API adapters' tests: token ``i`` is ``words[i]``, the text is split
on white space, and a word not in ``words`` is ``<unk>``."""

from __future__ import annotations

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from shared.tokenizer import Tokenizer


def word_tokenizer(words: list[str], chat_template: str | None, special_tokens: tuple[str, ...] = (),
                   **fields) -> Tokenizer:
    """``shared.tokenizer.Tokenizer`` over ``words`` (``special_tokens`` among them as special ones);
    ``fields``: its other arguments, no BOS or EOS token unless given."""
    backend = BackendTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    if special_tokens:
        backend.add_special_tokens(list(special_tokens))
    return Tokenizer(backend, chat_template=chat_template, **({"bos_token": None, "eos_token": None} | fields))
