"""The model's tokenizer: text <-> token ids, special and stop tokens, and the chat template.

One class for both model formats. ``from_gguf`` rebuilds the tokenizer from GGUF metadata;
``from_hf_dir`` reads a Hugging Face directory (``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json`` / ``config.json``). Either way the work is done by a Hugging Face
``tokenizers.Tokenizer`` (Rust), so encoding a long prompt stays fast.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer

from shared.tokenizer.chat_template import ChatTemplate, Message
from shared.tokenizer.gguf_vocab import build_backend, read_gguf_vocab

logger = logging.getLogger(__name__)

# Tokens that end a turn or a document in common chat models; each one present in the vocabulary
# stops generation along with EOS (a chat model may emit either).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|eom_id|>",
                      "<end_of_turn>", "</s>")


class Tokenizer:
    """Text <-> ids for one model. Immutable after construction and safe to share across threads
    (``tokenizers`` encode/decode take ``&self``)."""

    def __init__(self, backend: BackendTokenizer, *, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None, extra_stop_token_ids: Iterable[int] = (),
                 special_token_vars: Mapping[str, str | None] | None = None):
        """``bos_token``/``eos_token`` must be in ``backend``'s vocabulary when given.
        ``special_token_vars`` are extra template variables (unk_token, pad_token, ...)."""
        self._backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = self._require_id(bos_token)
        self.eos_token_id = self._require_id(eos_token)
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.stop_token_ids: tuple[int, ...] = self._stop_ids(extra_stop_token_ids)
        variables = {**(special_token_vars or {}), "bos_token": bos_token, "eos_token": eos_token}
        self._chat_template = ChatTemplate(chat_template, variables) if chat_template else None

    # ----- construction -----

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build from a GGUF file's ``tokenizer.*`` metadata. Raises ``ValueError`` if the file has
        none or uses an unsupported vocabulary kind."""
        vocab = read_gguf_vocab(Path(path))
        extra_stops = [vocab.eot_token_id] if vocab.eot_token_id is not None else []
        tokenizer = cls(build_backend(vocab), bos_token=vocab.token(vocab.bos_token_id),
                        eos_token=vocab.token(vocab.eos_token_id), chat_template=vocab.chat_template,
                        extra_stop_token_ids=extra_stops,
                        special_token_vars={"unk_token": vocab.token(vocab.unk_token_id),
                                            "pad_token": vocab.token(vocab.pad_token_id)})
        logger.debug("tokenizer from %s: %s/%s, %d tokens, eos %s, stop ids %s", path, vocab.model,
                     vocab.pre, tokenizer.vocab_size, tokenizer.eos_token_id, tokenizer.stop_token_ids)
        return tokenizer

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face model directory. ``tokenizer.json`` is required; the chat
        template comes from ``tokenizer_config.json`` or ``chat_template.jinja``; stop ids add the
        ``eos_token_id`` of ``generation_config.json`` and ``config.json``."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json")
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        extra_stops = [*_id_list(_read_json(path / "generation_config.json").get("eos_token_id")),
                       *_id_list(_read_json(path / "config.json").get("eos_token_id"))]
        eos = _token_text(config.get("eos_token"))
        if eos is None and extra_stops:
            eos = backend.id_to_token(extra_stops[0])
        return cls(backend, bos_token=_token_text(config.get("bos_token")), eos_token=eos,
                   chat_template=_hf_chat_template(path, config), extra_stop_token_ids=extra_stops,
                   special_token_vars={"unk_token": _token_text(config.get("unk_token")),
                                       "pad_token": _token_text(config.get("pad_token"))})

    @classmethod
    def from_model_files(cls, path: str | Path, model_format: str) -> Tokenizer:
        """The tokenizer of a resolved model (``ModelSource.path``, ``ModelSource.format``): a
        ``.gguf`` file for "gguf", a Hugging Face directory otherwise."""
        return cls.from_gguf(path) if model_format == "gguf" else cls.from_hf_dir(path)

    # ----- encode / decode -----

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) map to their
        ids. ``add_special_tokens`` adds what the model's post-processor adds (BOS for Llama 2)."""
        # encode_batch, not encode: tokenizers' encode holds the GIL for the whole call (2.7 s for a
        # 3.8 MB prompt), so a gateway tokenizing in a thread would still stall its event loop
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 sequences come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The backend tokenizer as ``tokenizer.json`` text (what grammar libraries read)."""
        return self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def special_token_id(self, token: str) -> int | None:
        """The id of ``token`` when it is a special token (one ``decode`` skips); None otherwise."""
        token_id = self._backend.token_to_id(token)
        return token_id if token_id in self.special_token_ids else None

    # ----- chat -----

    @property
    def chat_template(self) -> str | None:
        return self._chat_template.source if self._chat_template else None

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            extra_variables: Mapping[str, object] | None = None) -> str:
        """The prompt text for an OpenAI-style conversation, equal to transformers'
        ``apply_chat_template(messages, add_generation_prompt=..., tools=..., tokenize=False,
        **extra_variables)``. Raises ``ValueError`` naming the bad field, or when the model has no
        chat template."""
        if self._chat_template is None:
            raise ValueError("this model has no chat template; send a plain completion prompt")
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                          extra_variables=extra_variables)

    @property
    def chat_template_has_tools(self) -> bool:
        """Whether the chat template renders tool definitions itself."""
        return self._chat_template is not None and "tools" in self._chat_template.source

    # ----- helpers -----

    def _require_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the vocabulary")
        return token_id

    def _stop_ids(self, extra: Iterable[int]) -> tuple[int, ...]:
        # Only special tokens count: "</s>" can be an ordinary (HTML) token in a byte-level vocab.
        named = (i for i in map(self._backend.token_to_id, END_OF_TURN_TOKENS) if i in self.special_token_ids)
        ids = [self.eos_token_id, *extra, *named]
        # dict.fromkeys: deduplicate but keep EOS first
        return tuple(dict.fromkeys(i for i in ids if i is not None))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: object) -> str | None:
    """A special token as written in tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _hf_chat_template(path: Path, config: Mapping[str, object]) -> str | None:
    """``chat_template.jinja`` wins (newer layout); else the config's string, or the entry named
    "default" of its list of named templates."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of ``model`` (an alias, a ``.gguf`` file or a Hugging Face directory), for a
    process that needs the tokenizer without the weights."""
    from shared.model.registry import resolve_model  # noqa: PLC0415 — may fetch the model once

    source = resolve_model(model)
    return Tokenizer.from_model_files(source.path, source.format)
