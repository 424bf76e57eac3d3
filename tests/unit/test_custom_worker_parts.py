"""What a worker of one's own is given and how it is judged, without sockets: the EOS ids the
gateway puts in each token request (none in a text request, and a message without them still
parses), how ``tandem worker-check`` counts a text worker's chunks and notes a KV namespace, and
the gateway URL that ``connect.env`` carries and ``tandem status`` reads."""

from __future__ import annotations

import json

import pytest

from services.join.service import read_connect_file
from services.up.service import write_connect_file
from services.cli import build_parser
from services.commands.worker_check import namespace_note, text_chunk_tokens
from shared.kvcache.hashing import make_namespace
from shared.openai_api.adapters import ChatAdapter, CompletionAdapter
from shared.openai_api.generate_request import build_generate_request, build_text_request
from shared.protocol import GenerateRequest, TokenChunk, WorkerInfo
from services.stack.stack import Stack, StackSpec
from shared.tokenizer import Tokenizer
from word_tokens import word_tokenizer

WORDS = ["<unk>", "</s>", "<|im_end|>", "user", "assistant", ":", "hello", "world"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return word_tokenizer(WORDS, "", special_tokens=("</s>", "<|im_end|>"), eos_token="</s>",
                          extra_stop_token_ids=[2])


def test_a_token_request_carries_the_models_eos_ids_and_a_text_request_none(tok):
    assert tok.stop_token_ids == (1, 2)
    api = CompletionAdapter.from_json(json.dumps({"model": "m", "prompt": "hello world"}).encode(), tok)
    worker = WorkerInfo(worker_id="w1", role="decode", model="m", block_size=2, max_model_len=64, generate_subject="g")
    req = build_generate_request(api, api.prompt_ids(), tier="default", workers=[worker], served_models=["m"],
                                 default_max_tokens=8, now=0)
    assert req.sampling.eos_token_ids == [1, 2] and req.sampling.ignore_eos is False
    ignoring = CompletionAdapter.from_json(
        json.dumps({"model": "m", "prompt": "hello", "ignore_eos": True}).encode(), tok)
    req = build_generate_request(ignoring, ignoring.prompt_ids(), tier="default", workers=[worker],
                                 served_models=["m"], default_max_tokens=8, now=0)
    assert req.sampling.eos_token_ids == [1, 2] and req.sampling.ignore_eos is True  # the worker decides
    # on the wire, and back: a moved request (model_copy of the sampling) keeps them
    assert GenerateRequest.from_bytes(req.to_bytes()).sampling.eos_token_ids == [1, 2]
    chat = ChatAdapter.from_json(json.dumps({"model": "t", "messages": [{"role": "user", "content": "hi"}]}).encode(),
                                 tok)
    text = build_text_request(chat, model="t", tier="default", default_max_tokens=8, now=0)
    assert text.sampling.eos_token_ids == []  # the text worker's own tokenizer knows its EOS


def test_a_request_from_an_older_sender_without_eos_ids_still_parses():
    old = {"request_id": "r1", "model": "m", "prompt_token_ids": [5, 6], "sampling": {"max_tokens": 4}}
    assert GenerateRequest.from_bytes(json.dumps(old).encode()).sampling.eos_token_ids == []


@pytest.mark.parametrize("chunk, tokens", [
    ({"token_ids": [], "text": "hello"}, 1), ({"token_ids": [], "text": ""}, 1),
    ({"token_ids": [4, 5], "text": "ab"}, 2), ({"token_ids": [], "text": None, "finish_reason": "stop"}, 0)])
def test_a_text_workers_chunks_count_as_the_gateways_usage_counts_them(chunk, tokens):
    assert text_chunk_tokens(TokenChunk(request_id="r", index=0, **chunk)) == tokens


def test_a_kv_namespace_that_is_not_hex_is_a_note_not_a_failure():
    engine = make_namespace("m")
    assert namespace_note(engine.hex(), engine, "m") == ""
    assert "not the engine's for model 'm'" in namespace_note(b"other".hex(), engine, "m")
    note = namespace_note("m\x1f\x1f", engine, "m")  # the namespace sent as text
    assert note.startswith("; note: kv_namespace_hex 'm\\x1f\\x1f' is not hex") and "load alone" in note


def test_connect_env_names_the_gateway_and_tandem_status_reads_it(tmp_path, monkeypatch):
    stack = Stack(StackSpec(state_dir=tmp_path, port=18123, namespace="prod",
                            nats_url="nats://tandem:pw@127.0.0.1:4222", redis_url="redis://:pw@127.0.0.1:6379"))
    path = write_connect_file(stack)
    env = dict(line.split("=", 1) for line in path.read_text().splitlines())
    assert env["TANDEM_GATEWAY_URL"] == "http://127.0.0.1:18123"
    assert read_connect_file(path)["TANDEM_GATEWAY_URL"] == "http://127.0.0.1:18123"  # tandem join takes the file
    monkeypatch.delenv("TANDEM_GATEWAY_URL", raising=False)
    assert build_parser().parse_args(["status"]).url == "http://127.0.0.1:8000"
    monkeypatch.setenv("TANDEM_GATEWAY_URL", env["TANDEM_GATEWAY_URL"])
    assert build_parser().parse_args(["status"]).url == "http://127.0.0.1:18123"
    assert build_parser().parse_args(["status", "--url", "http://gw:9"]).url == "http://gw:9"
