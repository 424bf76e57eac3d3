import pytest
import torch

from shared.engine import EngineConfig, InvalidSamplingParamsError, LLMEngine, SamplingParams
from shared.engine.request import Request
from shared.engine.sampler import Sampler

V = 50


def logits_row(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * 3


def sample_many(params, n=200, row=None):
    sampler = Sampler(torch.device("cpu"))
    req = Request("r", [1, 2, 3], params)
    row = logits_row() if row is None else row
    return [sampler.sample(row[None].clone(), [req])[0].token_id for _ in range(n)]


def test_top_k_1_equals_greedy_through_the_sampling_path():
    row = logits_row()
    assert set(sample_many(SamplingParams(temperature=1.0, top_k=1), row=row)) == {int(row.argmax())}


def test_top_p_and_min_p_keep_sampling_inside_the_allowed_set():
    row = logits_row() / 3  # flat enough that both sets hold several tokens
    probs = torch.softmax(row, -1)
    sorted_p, order = probs.sort(descending=True)
    nucleus = set(order[:int((sorted_p.cumsum(0) < 0.6).sum()) + 1].tolist())
    got = set(sample_many(SamplingParams(temperature=1.0, top_p=0.6), row=row))
    assert got <= nucleus and len(got) > 1
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    got = set(sample_many(SamplingParams(temperature=1.0, min_p=0.2), row=row))
    assert got <= allowed and len(got) > 1


def test_seeded_samples_do_not_depend_on_batch_mates():
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(torch.device("cpu"), seed=1)
    crowd = Sampler(torch.device("cpu"), seed=2)
    rows = torch.stack([logits_row(i) for i in range(3)])
    a = [alone.sample(rows[1:2].clone(), [Request("x", [1], params)])[0].token_id for _ in range(20)]
    mates = [Request("m1", [1], SamplingParams(temperature=1.0)), Request("x", [1], params),
             Request("m2", [1], SamplingParams(temperature=0.7, seed=9))]
    b = [crowd.sample(rows.clone(), mates)[1].token_id for _ in range(20)]
    assert a == b and len(set(a)) > 1


def test_penalties_push_away_from_seen_tokens():
    row = logits_row()
    best = int(row.argmax())
    req = Request("r", [best], SamplingParams(temperature=0.0, repetition_penalty=100.0))
    assert Sampler(torch.device("cpu")).sample(row[None].clone(), [req])[0].token_id != best
    req = Request("r", [0], SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0))
    req.output_token_ids = [best] * 5
    assert Sampler(torch.device("cpu")).sample(row[None].clone(), [req])[0].token_id != best


def test_logprobs_are_of_the_raw_distribution():
    row = logits_row()
    req = Request("r", [1], SamplingParams(temperature=0.0, logprobs=3))
    tok = Sampler(torch.device("cpu")).sample(row[None].clone(), [req])[0]
    ref = torch.log_softmax(row, -1)
    assert tok.token_id == int(ref.argmax())
    assert tok.logprob == pytest.approx(float(ref.max()), abs=1e-6)
    assert [t for t, _ in tok.top_logprobs] == ref.topk(3).indices.tolist()


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_k", -1), ("min_p", 1.5), ("max_tokens", 0),
    ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("logprobs", 50), ("seed", -1),
    ("stop_token_ids", [V + 5]),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(InvalidSamplingParamsError, match=field) as info:
        SamplingParams(**{field: value}).validate(V)
    assert info.value.field == field


def test_stop_tokens_eos_and_max_tokens(tiny_engine_model):
    prompt = list(range(10, 30))
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=2 << 20), eos_token_ids=frozenset())
    (full,) = engine.generate([prompt], greedy)
    assert len(full) == 10
    stop_at = next(i for i in range(2, 10) if full[i] not in full[:i])
    outs = []
    engine.add_request("s", prompt, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[full[stop_at]]))
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.new_token_ids[0] for o in outs] == full[:stop_at + 1]
    assert outs[-1].finish_reason == "stop" and all(o.finish_reason is None for o in outs[:-1])
    eos_engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=2 << 20),
                           eos_token_ids=frozenset([full[stop_at]]))
    assert eos_engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0)) == [full[:stop_at + 1]]
    assert eos_engine.generate([prompt], greedy) == [full]  # ignore_eos
    engine.add_request("l", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 3


def test_unseeded_requests_differ_across_engines_and_seeded_ones_do_not(tiny_engine_model):
    """Two engines from one config (as two workers, or one after a restart): an unseeded request at
    temperature 1 gets different tokens on each (40 tokens of a random model: a collision is
    practically impossible), a seeded one the same tokens on both."""
    config = EngineConfig(kv_cache_memory=2 << 20)
    engines = [LLMEngine(tiny_engine_model, config, eos_token_ids=frozenset()) for _ in range(2)]
    prompt = list(range(10, 30))
    unseeded = SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
    a, b = (e.generate([prompt], unseeded)[0] for e in engines)
    assert a != b
    a, b = (e.generate([prompt], seeded)[0] for e in engines)
    assert a == b and len(set(a)) > 1


def test_a_configured_engine_seed_fixes_unseeded_samples(tiny_engine_model):
    config = EngineConfig(kv_cache_memory=2 << 20, seed=5)
    params = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    runs = [LLMEngine(tiny_engine_model, config, eos_token_ids=frozenset()).generate([list(range(10, 30))], params)
            for _ in range(2)]
    assert runs[0] == runs[1]
