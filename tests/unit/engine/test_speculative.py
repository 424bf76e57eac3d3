"""Speculative decoding with n-gram drafts: the proposer, the per-request policy, the sampler's
verification (greedy exact; sampling keeps its distribution, checked with a fixed seed), and an
engine on a tiny random model giving the same greedy tokens with and without speculation, and
with int8 layers the same logits bit for bit, eager and compiled."""

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine
from shared.engine.request import Request, SamplingParams
from shared.engine.sampler import Sampler, filter_probs
from shared.engine.speculative import NgramProposer, SpeculativeConfig, Speculator
from shared.grammar.spec import GrammarSpec


def request(tokens, rid="r", **params):
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 100)
    return Request(rid, list(tokens), SamplingParams(**params))


def test_the_draft_is_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    proposer = NgramProposer(min_ngram=2, max_ngram=3)
    r = request([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert proposer.propose(r, 3) == [7, 8, 5]  # "2 3" last seen before 7 8 5 (the latest occurrence)
    r.output_token_ids += [7]  # the index grows with the request: "3 7" occurred before 8 5 2
    assert proposer.propose(r, 2) == [8, 5]
    assert NgramProposer(2, 3).propose(request([5, 6, 7, 8]), 4) == []  # nothing repeats


def test_the_incremental_index_finds_what_a_full_scan_finds():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=gen).tolist()
    incremental, r = NgramProposer(2, 4), request(tokens[:20])
    for t in tokens[20:]:
        fresh = NgramProposer(2, 4).propose(request(r.all_token_ids), 5)
        assert incremental.propose(r, 5) == fresh
        r.output_token_ids.append(t)


def test_who_speculates_and_how_far():
    spec = Speculator(SpeculativeConfig(num_tokens=4, max_batch=2))
    spec.begin_step()
    looping = [1, 2, 3, 4] * 4
    assert spec.draft(request(looping), 1, 1024) == [1, 2, 3, 4]
    assert spec.draft(request(looping), 3, 1024) == []  # a batch over max_batch
    assert spec.draft(request(looping, max_tokens=3), 1, 1024) == [1, 2]  # no draft past max_tokens
    assert spec.draft(request(looping), 1, 18) == [1]  # nor past the context
    for params in ({"seed": 1, "temperature": 1.0}, {"logprobs": 2}, {"repetition_penalty": 1.2},
                   {"logit_bias": {5: 1.0}}, {"grammar": GrammarSpec("json_object")}):
        assert spec.draft(request(looping, **params), 1, 1024) == [], params
    assert spec.draft(request(looping, temperature=0.8, top_p=0.9), 1, 1024) != []


def test_a_request_whose_drafts_fail_pauses_then_tries_again():
    cfg = SpeculativeConfig(num_tokens=4, pause_steps=5)
    spec, r = Speculator(cfg), request([1, 2, 3, 4] * 4)
    spec.begin_step()
    for _ in range(4):
        spec.observe("r", 4, 0)
    assert spec.draft(r, 1, 1024) == []
    for _ in range(5):
        spec.begin_step()
    assert spec.draft(r, 1, 1024) != []
    assert spec.stats.num_drafted == 16 and spec.stats.num_accepted == 0


def test_greedy_verification_keeps_the_draft_while_it_is_the_argmax():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 8, 6]):
        logits[row, best] = 5.0
    sampler, r = Sampler(torch.device("cpu")), request([1])
    assert sampler.verify(logits, r, [3, 4, 5]) == [3, 4, 8]  # the third draft is not the argmax
    assert sampler.verify(logits, r, [3, 4, 8]) == [3, 4, 8, 6]  # all kept, and one more
    assert sampler.verify(logits, r, [0, 4, 8]) == [3]


def test_sampled_verification_keeps_each_tokens_distribution():
    """Two draft tokens over three rows of fixed logits: the first emitted token follows row 0's
    filtered distribution, and the second, given the first was the draft, row 1's (fixed seed,
    20,000 draws; total variation under 0.02 where sampling noise is ~0.005)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 12, generator=gen) * 2
    r = request([1], temperature=0.9, top_k=8, top_p=0.95)
    sampler = Sampler(torch.device("cpu"), seed=11)
    draft = [int(logits[0].argmax()), int(logits[1].argsort()[-2])]  # a likely and a less likely guess
    first, second = torch.zeros(12), torch.zeros(12)
    for _ in range(20_000):
        out = sampler.verify(logits, r, draft)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    p0, p1 = filter_probs(logits[0], r), filter_probs(logits[1], r)
    assert 0.5 * (first / first.sum() - p0).abs().sum() < 0.02
    assert 0.5 * (second / second.sum() - p1).abs().sum() < 0.02
    assert first[p0 == 0].sum() == 0 and second[p1 == 0].sum() == 0  # nothing top-k/top-p removed


def test_an_engine_gives_the_same_greedy_tokens_with_and_without_speculation(tiny_engine_model):
    prompts = [[5, 6, 7, 8, 9, 10] * 6, list(range(20, 60)), [3, 4] * 12 + [11, 12, 13]]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def run(prompts, **kw):
        engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=2 << 20, block_size=8, **kw),
                           eos_token_ids=frozenset())
        outs = engine.generate(prompts, greedy)
        engine.kv.check_integrity()
        return outs, engine.stats()

    plain, _ = run(prompts)
    for tokens in (2, 5):
        spec, stats = run(prompts, speculative_tokens=tokens, speculative_max_batch=4)
        assert spec == plain
        assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    # alone, a request takes one step less per accepted draft token
    _, alone = run(prompts[2:])
    _, fast = run(prompts[2:], speculative_tokens=5)
    assert fast.num_accepted_tokens > 0 and fast.num_steps == alone.num_steps - fast.num_accepted_tokens


def test_a_stop_token_inside_an_accepted_draft_ends_the_request_there(tiny_engine_model):
    prompt = [5, 6, 7, 8, 9, 10] * 6
    engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=2 << 20, block_size=8), eos_token_ids=frozenset())
    (full,) = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stop_at = next(i for i in range(3, 30) if full[i] not in full[:i - 1] or i == 29)
    spec = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=2 << 20, block_size=8, speculative_tokens=6),
                     eos_token_ids=frozenset())
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[full[stop_at]])
    (stopped,) = spec.generate([prompt], params)
    assert stopped == full[:full.index(full[stop_at]) + 1]
    spec.kv.check_integrity()
    assert spec.kv.pool.num_free_blocks == spec.kv.pool.num_blocks


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_a_verified_draft_token_gets_the_bits_of_a_plain_decode_row(tmp_path, compile_mode, record_logits):
    """With int8 layers (exact integer sums per row) a speculative entry's tokens run as decode rows,
    each over the past a plain decode row at its position has (in the compiled step, the step's
    own earlier K/V taken from its rows): the logits of every verified position are bit for bit
    those of decoding without speculation, eager and compiled, so int8 greedy text cannot differ."""
    from shared.model.loader import load_model
    from tiny_hf_models import save_tiny

    save_tiny("llama", tmp_path)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    model.quantize("int8", list(range(3, 60)))
    prompts = [[5, 6, 7, 8, 9, 10] * 6, list(range(20, 60)), [3, 4] * 12 + [11, 12, 13]]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def run(speculative_tokens: int):
        engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=4, compile=compile_mode,
                                               quantization="int8", speculative_tokens=speculative_tokens),
                           eos_token_ids=frozenset())
        seen = record_logits(engine)
        outs = engine.generate(prompts, greedy)
        engine.kv.check_integrity()
        return outs, seen, engine.stats()

    plain, plain_logits, _ = run(0)
    spec, spec_logits, stats = run(5)
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    if compile_mode == "on":
        assert stats.decode_step == "compiled"
    assert spec == plain
    assert spec_logits.keys() == plain_logits.keys()
    for position, row in spec_logits.items():
        assert torch.equal(row, plain_logits[position]), position
