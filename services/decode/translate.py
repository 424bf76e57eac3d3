"""Wire ↔ engine translation for the decode worker (the engine never sees protocol types)."""

from __future__ import annotations

from shared.engine import EngineOutput, SamplingParams as EngineSamplingParams
from shared.grammar import GrammarSpec
from shared.protocol import SamplingParams, TokenChunk, TokenLogprob, TopLogprob


def engine_params(p: SamplingParams) -> EngineSamplingParams:
    return EngineSamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        min_p=p.min_p, seed=p.seed, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=p.logprobs,
        logit_bias=dict(p.logit_bias) if p.logit_bias else None,
        grammar=GrammarSpec(p.grammar.kind, p.grammar.value) if p.grammar else None,
        num_output_in_prompt=p.num_output_in_prompt, decode_path=p.decode_path)


def token_chunk(out: EngineOutput, index: int, worker_id: str) -> TokenChunk:
    logprobs = None
    if out.logprobs is not None:
        logprobs = [TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                 top=[TopLogprob(token_id=t, logprob=v) for t, v in lp.top_logprobs])
                    for lp in out.logprobs]
    return TokenChunk(request_id=out.request_id, index=index, token_ids=list(out.new_token_ids),
                      logprobs=logprobs, finish_reason=out.finish_reason,
                      num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                      worker_id=worker_id, decode_path=out.decode_path)
