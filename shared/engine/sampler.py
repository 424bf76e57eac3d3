"""Token sampling for a batch of requests, each with its own parameters.

Per-request seeds give reproducible samples regardless of batch-mates: a seeded request draws its
noise from its own ``torch.Generator``, one draw per sampled token. Logprobs are those of the raw
model distribution (before logit bias, penalties and temperature), as OpenAI-compatible servers
report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.request import Request
from shared.grammar.matcher import GrammarTable, TokenizerGrammars


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


def apply_penalties(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """Repetition penalty over prompt+output tokens; presence/frequency over output tokens."""
    params = request.sampling_params
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long, device=device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if request.output_token_ids and (params.presence_penalty or params.frequency_penalty):
        out_ids = torch.tensor(request.output_token_ids, dtype=torch.long, device=device)
        counts = torch.zeros_like(logits).scatter_add_(0, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits: [S, V]. Adds each request's ``logit_bias``; a bias of -100 bans the token outright
    (-inf), as OpenAI documents, rather than merely making it unlikely. Returns a new tensor when
    any request has a bias, else ``logits`` itself."""
    rows = [(i, r.sampling_params.logit_bias) for i, r in enumerate(requests) if r.sampling_params.logit_bias]
    if not rows:
        return logits
    logits = logits.clone()
    for i, bias in rows:
        ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
        vals = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        logits[i, ids] += vals.masked_fill(vals <= -100.0, float("-inf"))
    return logits


def filter_probs(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row of logits; returns probabilities."""
    params = request.sampling_params
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def apply_grammars(logits: torch.Tensor, requests: list[Request], table: GrammarTable | None) -> torch.Tensor:
    """logits: [S, V]. Tokens that the grammar of a request (if it has one) does not allow next
    get -inf; the masks of the whole batch come from one call (prefetched while the forward ran,
    see GrammarTable). Returns a new tensor when any request has a grammar, else ``logits``."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.grammar is not None]
    if not rows:
        return logits
    if table is None:
        raise RuntimeError("a request has a grammar but the sampler was built without a tokenizer")
    allowed = table.masks_for([_grammar_item(requests[i]) for i in rows]).to(logits.device)  # [R, V]
    logits = logits.clone()
    sub = logits[rows]
    width = min(sub.shape[-1], allowed.shape[-1])
    sub[:, :width] = sub[:, :width].masked_fill(~allowed[:, :width], float("-inf"))
    sub[:, width:] = float("-inf")  # ids the tokenizer does not know
    logits[rows] = sub
    return logits


def _grammar_item(request: Request, *new_tokens: int) -> tuple:
    return request.request_id, request.sampling_params.grammar, request.grammar_token_ids + list(new_tokens)


def _default_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """The generator of unseeded requests: seeded from the OS when ``seed`` is None, since a fixed
    seed would make the same unseeded request give the same text after every restart and on every
    worker."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()  # a nondeterministic seed (std::random_device)
    else:
        gen.manual_seed(seed)
    return gen


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None,
                 grammars: TokenizerGrammars | None = None) -> None:
        self.device = device
        self._default = _default_generator(device, seed)
        self._generators: dict[str, torch.Generator] = {}
        self.grammars = GrammarTable(grammars) if grammars is not None else None

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.forget(request_id)

    def _generator(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self._default
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = self._generators[request.request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return gen

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """logits: [S, V] float32, one row per request (in order)."""
        want_logprobs = [r.sampling_params.logprobs is not None for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        logits = apply_grammars(apply_logit_bias(logits, requests), requests, self.grammars)
        greedy_ids = logits.argmax(dim=-1).tolist()
        results = []
        for i, request in enumerate(requests):
            params = request.sampling_params
            if params.is_greedy and not params.has_penalties:
                token = greedy_ids[i]
            else:
                row = apply_penalties(logits[i].clone(), request) if params.has_penalties else logits[i]
                if params.is_greedy:
                    token = int(row.argmax())
                else:
                    probs = filter_probs(row, request)
                    # exponential race (Gumbel-max in disguise): one noise draw per token
                    noise = torch.empty_like(probs).exponential_(generator=self._generator(request))
                    token = int((probs / noise).argmax())
            results.append(self._with_logprobs(token, raw_logprobs, i, params.logprobs))
        if self.grammars is not None:  # the next step's masks, while its forward runs
            self.grammars.prefetch([_grammar_item(r, t.token_id) for r, t in zip(requests, results)
                                    if r.sampling_params.grammar is not None])
        return results

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, request: Request, draft: list[int]) -> list[int]:
        """The tokens a speculative step yields: ``logits`` [k+1, V] are the rows of the request's
        last token and of its ``k`` draft tokens (``draft``). Returns the accepted draft prefix
        and one token more (the argmax or a sample after it), so 1 to k+1 tokens.

        Greedy: a draft token is kept while it equals the argmax, so the text is the one decoding
        token by token gives. Sampled (no seed, no penalties: see ``can_speculate``): draft token
        ``d`` is kept with probability p(d) under the request's filtered distribution; on a
        rejection the token is drawn from p without ``d`` (renormalized). With a one-hot proposal
        that is exactly speculative sampling, so each token keeps its distribution."""
        params = request.sampling_params
        if params.is_greedy:
            best = logits.argmax(dim=-1).tolist()
            out = []
            for i, d in enumerate(draft):
                if d != best[i]:
                    break
                out.append(d)
            return out + [best[len(out)]]
        out = []
        gen = self._default
        for i, d in enumerate(draft):
            probs = filter_probs(logits[i], request)
            if float(torch.rand((), generator=gen, device=probs.device)) < float(probs[d]):
                out.append(d)
                continue
            rest = probs.clone()
            rest[d] = 0.0
            return out + [int(torch.multinomial(rest / rest.sum(), 1, generator=gen))]
        probs = filter_probs(logits[len(draft)], request)
        return out + [int(torch.multinomial(probs, 1, generator=gen))]

    @staticmethod
    def _with_logprobs(token: int, raw: torch.Tensor | None, row: int, top_n: int | None) -> SampledToken:
        if raw is None or top_n is None:
            return SampledToken(token)
        top = ()
        if top_n:
            vals, ids = raw[row].topk(top_n)
            top = tuple(zip(ids.tolist(), vals.tolist()))
        return SampledToken(token, float(raw[row, token]), top)
