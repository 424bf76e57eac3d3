"""Grammar state per request and the batch's token masks.

A request's state is a function of the tokens it has generated under its grammar, and nothing
else: ``GrammarTable.masks`` brings each matcher up to the request's tokens before computing its
mask (the token sampled last step is consumed then). So a preempted request, whose tokens are
kept, continues where it was; a matcher that is lost or behind (a request that moved to another
worker with its output so far appended to its prompt) is rebuilt and replayed from the tokens.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from shared.grammar.spec import GrammarSpec, compile_grammar

log = logging.getLogger(__name__)


class TokenizerGrammars:
    """One model's vocabulary as llguidance sees it (building it takes about a second: once per
    engine), and the factory of matchers over it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.ll_tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                   eos_token=self.eos_token_ids)
        self.executor = llguidance.LLExecutor()
        # the special tokens by text: a tool-call grammar's ``special_token`` items become these ids
        self.special_ids = {t["content"]: t["id"] for t in json.loads(tokenizer_json).get("added_tokens", [])
                            if t.get("special") and t["id"] < vocab_size}

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """Raises GrammarError for a grammar that does not compile."""
        keys = UniqueKeys(self) if spec.kind == "json_object" else None
        return GrammarMatcher(llguidance.LLMatcher(self.ll_tokenizer, compile_grammar(spec, self.special_ids),
                                                   log_level=0), keys)

    def token_bytes(self, token_ids: Sequence[int]) -> bytes:
        return self.ll_tokenizer.decode_bytes(list(token_ids))

    @functools.cached_property
    def sorted_tokens(self) -> tuple[list[bytes], list[int]]:
        """Every non-special token's bytes, sorted, and its id: the tokens that start with given
        bytes are one range of it (bisect)."""
        pairs = sorted((self.ll_tokenizer.decode_bytes([t]), t) for t in range(self.vocab_size)
                       if not self.ll_tokenizer.is_special_token(t))
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def tokens_starting_with(self, prefix: bytes) -> list[int]:
        texts, ids = self.sorted_tokens
        lo = bisect.bisect_left(texts, prefix)
        hi = lo
        while hi < len(texts) and texts[hi].startswith(prefix):
            hi += 1
        return ids[lo:hi]


class UniqueKeys:
    """``json_object``: no key twice in one object, which no context-free grammar can say. The
    output's bytes are followed as JSON (valid: the grammar sees to that); inside an object's key,
    tokens that would close it as a key that object already has are masked out."""

    def __init__(self, grammars: TokenizerGrammars) -> None:
        self.grammars = grammars
        self.stack: list[tuple[set[bytes], list[bool]] | None] = []  # objects: (keys, [expect a key]); arrays: None
        self.in_string = self.in_key = self.escaped = False
        self.key = bytearray()

    def feed(self, data: bytes) -> None:
        for byte in data:
            ch = chr(byte)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.in_key:
                        self.stack[-1][0].add(bytes(self.key))
                        self.stack[-1][1][0] = False
                    continue
                if self.in_key:
                    self.key.append(byte)
            elif ch == "{":
                self.stack.append((set(), [True]))
            elif ch == "[":
                self.stack.append(None)
            elif ch in "}]" and self.stack:
                self.stack.pop()
            elif ch == "," and self.stack and self.stack[-1] is not None:
                self.stack[-1][1][0] = True
            elif ch == '"':
                top = self.stack[-1] if self.stack else None
                self.in_string, self.in_key, self.key = True, top is not None and top[1][0], bytearray()

    def banned(self) -> list[int]:
        """Tokens that would end the key being written as one its object already has."""
        if not (self.in_string and self.in_key) or self.escaped:
            return []
        written = bytes(self.key)
        return [t for key in self.stack[-1][0] if key.startswith(written)
                for t in self.grammars.tokens_starting_with(key[len(written):] + b'"')]


class GrammarMatcher:
    """One request's position in its grammar: the tokens consumed so far."""

    def __init__(self, ll_matcher: llguidance.LLMatcher, keys: UniqueKeys | None = None) -> None:
        self.ll = ll_matcher
        self.keys = keys
        self.num_consumed = 0

    def advance_to(self, token_ids: Sequence[int]) -> None:
        """Consume ``token_ids[num_consumed:]``; ``token_ids`` extends what was consumed before."""
        new = token_ids[self.num_consumed:]
        for token in new:
            if not self.ll.is_stopped():
                self.ll.consume_token(token)
        if self.keys is not None and new:
            self.keys.feed(self.keys.grammars.token_bytes(new))
        self.num_consumed = len(token_ids)

    @property
    def is_error(self) -> bool:
        return self.ll.is_error()


class GrammarTable:
    """request id → matcher, for the requests of one sampler that have a grammar.

    ``prefetch`` (called right after sampling, with the tokens just sampled) consumes them and
    computes the next step's masks on a worker thread — llguidance releases the GIL — while the
    next forward runs, as vLLM and SGLang overlap them. ``masks_for`` uses a prefetched row only
    when it was computed for exactly the request's tokens now; anything else is computed then.
    Matchers are touched by one thread at a time: every entry point first waits for the prefetch.
    """

    def __init__(self, grammars: TokenizerGrammars) -> None:
        self.grammars = grammars
        self._matchers: dict[str, GrammarMatcher] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._pending: Future | None = None
        self._prefetched: dict[str, tuple[tuple, torch.Tensor]] = {}  # id → (tokens' key, allowed [V])
        self.num_prefetch_hits = 0

    def forget(self, request_id: str) -> None:
        self._wait()
        self._matchers.pop(request_id, None)
        self._prefetched.pop(request_id, None)

    def prefetch(self, items: Sequence[tuple[str, GrammarSpec, list[int]]]) -> None:
        """Start computing the masks after ``items``' (request id, spec, tokens so far) tokens."""
        self._wait()
        self._prefetched.clear()
        if items:
            self._pending = self._pool.submit(self._compute, list(items))

    def _compute(self, items: list[tuple[str, GrammarSpec, list[int]]]) -> None:
        matchers = [self.sync(rid, spec, tokens) for rid, spec, tokens in items]
        allowed = self.masks(matchers)
        self._prefetched = {rid: (_key(tokens), allowed[i]) for i, (rid, _, tokens) in enumerate(items)}

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except Exception:  # noqa: BLE001 — the masks are computed again when needed
                log.exception("grammar prefetch failed")
                self._prefetched.clear()

    def masks_for(self, items: Sequence[tuple[str, GrammarSpec, list[int]]]) -> torch.Tensor:
        """allowed: [len(items), vocab] bool after each item's tokens: prefetched rows where they
        match, the rest computed now in one call."""
        self._wait()
        rows: list[torch.Tensor | None] = []
        for rid, _, tokens in items:
            hit = self._prefetched.get(rid)
            rows.append(hit[1] if hit is not None and hit[0] == _key(tokens) else None)
        self.num_prefetch_hits += sum(r is not None for r in rows)
        missing = [i for i, r in enumerate(rows) if r is None]
        if missing:
            computed = self.masks([self.sync(*items[i]) for i in missing])
            for j, i in enumerate(missing):
                rows[i] = computed[j]
        return torch.stack(rows)

    def sync(self, request_id: str, spec: GrammarSpec, token_ids: Sequence[int]) -> GrammarMatcher:
        """The request's matcher, having consumed exactly ``token_ids`` (rebuilt and replayed
        when it is missing or has consumed more, e.g. after a restart of the request)."""
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.num_consumed > len(token_ids):
            matcher = self._matchers[request_id] = self.grammars.matcher(spec)
        matcher.advance_to(token_ids)
        return matcher

    def masks(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """allowed: [len(matchers), vocab] bool. A matcher in an error state (it was handed a token
        its grammar refuses) allows only the end-of-sequence tokens, so its request ends."""
        # one bit per token, 32 to an int32 word, all allowed until llguidance writes a row; filled
        # through the raw executor call, not llguidance.torch, whose import torch.compiles a helper
        # (pulling in inductor and triton, seconds per process) that we do not use
        bitmask = torch.full((len(matchers), -(-self.grammars.vocab_size // 32)), -1, dtype=torch.int32)
        healthy = [(m.ll, row) for row, m in enumerate(matchers) if not m.is_error]
        if healthy:
            self.grammars.executor.unsafe_compute_mask_ptr(healthy, bitmask.data_ptr(), bitmask.shape[1] * 4,
                                                           len(matchers))
        allowed = unpack_bitmask(bitmask, self.grammars.vocab_size)
        for row, m in enumerate(matchers):
            if m.keys is not None and not m.is_error and (banned := m.keys.banned()):
                allowed[row, banned] = False
            if m.is_error:
                log.warning("grammar matcher in error (%s); ending the request", m.ll.get_error())
                allowed[row] = False
                allowed[row, self.grammars.eos_token_ids] = True
        return allowed


def _key(tokens: Sequence[int]) -> tuple:
    """Which tokens a prefetched mask was computed after (they only ever grow by appending)."""
    return len(tokens), tokens[-1] if tokens else None


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask: [S, ceil(V / 32)] int32, bit j of word w is token 32w + j → [S, V] bool."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [S, W, 32]
    return bits.flatten(1)[:, :vocab_size].bool()
