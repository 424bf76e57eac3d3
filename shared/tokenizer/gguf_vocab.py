"""Build a Hugging Face ``tokenizers.Tokenizer`` from the vocabulary stored in a GGUF file.

A GGUF carries no ``tokenizer.json``: it stores the tokens, merges, token types and special ids
under llama.cpp's ``tokenizer.ggml.*`` keys. Two vocabulary kinds are rebuilt here:

- ``gpt2``: byte-level BPE (SmolLM, Llama 3, Qwen2, ...). The pre-tokenizer split is picked from
  ``tokenizer.ggml.pre``, as llama.cpp does, because the merges were learned on that split.
- ``llama``: SentencePiece-style BPE over ``▁``-spelled pieces with byte fallback (Llama 2,
  Mistral, ...). Files without merges get them derived from the token scores.

Token types follow llama.cpp: CONTROL tokens become special added tokens (matched whole in text,
dropped by ``skip_special_tokens``), USER_DEFINED ones plain added tokens (matched whole, kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

# llama.cpp's token types (gguf.TokenType)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(1, 7)

SPM_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> the regex split its merges were learned on. Absent: GPT-2's own regex.
_PRE_SPLITS: dict[str, str] = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen"], _QWEN2_SPLIT),
}
# These split every digit on its own before GPT-2's regex (llama.cpp: "\p{N}" first).
_DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"})


@dataclass(frozen=True)
class GgufVocab:
    """The ``tokenizer.*`` metadata of a GGUF file. Lists are indexed by token id; ``token_types``
    and ``scores`` are empty when the file omits them."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    eot_token_id: int | None
    add_bos_token: bool
    add_space_prefix: bool
    chat_template: str | None

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None or not 0 <= token_id < len(self.tokens) else self.tokens[token_id]


def read_gguf_vocab(path: Path) -> GgufVocab:
    """Read the tokenizer metadata of the GGUF at ``path``. Raises ``ValueError`` if it has none."""
    from shared.model.gguf_file import read_gguf

    gguf = read_gguf(path)

    def get(key: str, default=None):
        return gguf.get(f"tokenizer.{key}", default)

    model = get("ggml.model")
    if model is None or get("ggml.tokens") is None:
        raise ValueError(f"{path} has no tokenizer metadata (tokenizer.ggml.model / tokens)")
    return GgufVocab(
        model=model, pre=get("ggml.pre"), tokens=get("ggml.tokens"),
        token_types=get("ggml.token_type", []), scores=get("ggml.scores", []),
        merges=get("ggml.merges", []),
        bos_token_id=get("ggml.bos_token_id"), eos_token_id=get("ggml.eos_token_id"),
        unk_token_id=get("ggml.unknown_token_id"), pad_token_id=get("ggml.padding_token_id"),
        eot_token_id=get("ggml.eot_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        add_bos_token=bool(get("ggml.add_bos_token", model == "llama")),
        add_space_prefix=bool(get("ggml.add_space_prefix", model == "llama")),
        chat_template=get("chat_template"),
    )


def build_backend(vocab: GgufVocab) -> BackendTokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to the one the GGUF describes, with BOS added by
    ``encode(..., add_special_tokens=True)`` iff the file asks for it."""
    if vocab.model == "gpt2":
        backend = _byte_level_bpe(vocab)
    elif vocab.model == "llama":
        backend = _sentencepiece_bpe(vocab)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {vocab.model!r} "
                         "(tokenizer.ggml.model); supported: 'gpt2', 'llama'")
    _add_special_tokens(backend, vocab)
    bos = vocab.token(vocab.bos_token_id)
    if vocab.add_bos_token and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_token_id)])
    return backend


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used to spell byte-level tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _token_type(vocab: GgufVocab, token_id: int) -> int:
    return vocab.token_types[token_id] if token_id < len(vocab.token_types) else TOKEN_NORMAL


def _is_added(token_type: int) -> bool:
    return token_type in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)


def _byte_level_bpe(vocab: GgufVocab) -> BackendTokenizer:
    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    ids: dict[str, int] = {}
    for token_id, token in enumerate(vocab.tokens):
        # Some converters store plain tokens raw (e.g. with a real space); re-spell those in the byte
        # alphabet so BPE can reach them. Added tokens keep their text: they are matched verbatim.
        if not _is_added(_token_type(vocab, token_id)) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        ids.setdefault(token, token_id)
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    backend = BackendTokenizer(BPE(ids, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(vocab.pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split = _PRE_SPLITS.get(pre or "")
    if split is not None:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _sentencepiece_bpe(vocab: GgufVocab) -> BackendTokenizer:
    ids: dict[str, int] = {}
    for token_id, token in enumerate(vocab.tokens):
        ids.setdefault(token, token_id)
    merges = ([tuple(m.split(" ", 1)) for m in vocab.merges] if vocab.merges
              else merges_from_scores(vocab))
    backend = BackendTokenizer(BPE(ids, merges, unk_token=vocab.token(vocab.unk_token_id),
                                   fuse_unk=True, byte_fallback=True))
    prepend = "first" if vocab.add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM_SPACE, prepend_scheme=prepend, split=False)
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(vocab: GgufVocab) -> list[tuple[str, str]]:
    """BPE merges implied by a scored SentencePiece vocabulary: every split of a normal token into
    two known tokens, best merged-token score first (llama.cpp's SPM merges by these scores)."""
    if len(vocab.scores) != len(vocab.tokens):
        raise ValueError(f"GGUF vocabulary has no merges and {len(vocab.scores)} scores for "
                         f"{len(vocab.tokens)} tokens; cannot derive merges")
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token_id, token in enumerate(vocab.tokens):
        if _token_type(vocab, token_id) != TOKEN_NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-vocab.scores[token_id], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _add_special_tokens(backend: BackendTokenizer, vocab: GgufVocab) -> None:
    special, plain = [], []
    for token_id, token in enumerate(vocab.tokens):
        token_type = _token_type(vocab, token_id)
        if token_type in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TOKEN_USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)
