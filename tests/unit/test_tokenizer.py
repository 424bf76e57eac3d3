"""Tokenizer, chat template and incremental detokenizer, checked against transformers loading the
same GGUF (the reference the engine's token-for-token tests use too)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from jinja2.exceptions import SecurityError

from shared.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.tokenizer.chat_template import ChatTemplate
from shared.tokenizer.gguf_vocab import SPM_SPACE

TEXTS = [
    "Hello, world!",
    "The year 2024 had 365 days; pi ~ 3.14159 and 1,000,000 > 999.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # slow\n",
    "    leading spaces, trailing spaces   ",
    "tabs\tand\t\ttabs\n\n\nblank lines\r\nCRLF",
    "héllo wörld, crème brûlée, naïve façade",
    "日本語のテキストと中文字符，한국어도",
    "emoji 🎉🚀 flags 🇫🇷 family 👨‍👩‍👧 skin 👍🏽",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <repo_name>x",
    "<|im_start|",  # not a special token: plain text
    "",
    " ",
    "\n",
    "a  b   c    d",
    "€$£¥ ±×÷ ∀∃∈ αβγ",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write a haiku about 🌊 and naïve code.\n\nThanks"}],
    [{"role": "system", "content": ""},
     {"role": "user", "content": "  spaces  "}],
]


@pytest.fixture(scope="module")
def tok(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def ref(smollm2_gguf: Path):
    import transformers  # a declared dependency: missing, the tests fail
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


# ----- encode / decode -----

@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, ref, text):
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == ref(text)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tok, ref, text):
    ids = ref.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE round-trips


# No digits: around them we deliberately differ from transformers (see the test below).
FUZZ_PIECES = [*"abcXYZ \t\n\r.,;'\"!?()[]{}<>|_-+=*/\\#@$%^&~`éüñßçøæ日本語中文한국🎉🚀👍🏽\u200d\u00a0\u3000",
               "<|im_start|>", "<|im_end|>", "<|endoftext|>", "'s", "'ll", "  ", "\n\n", "http://x.y/z?q"]


def test_encode_matches_transformers_on_random_text(tok, ref):
    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(1, 40)))
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize(("text", "pieces"), [
    ("  1", ["ĠĠ", "1"]),
    ("x\n\n0", ["x", "ĊĊ", "0"]),
    ("a   42", ["a", "ĠĠĠ", "4", "2"]),
])
def test_digits_are_split_before_whitespace_as_llama_cpp_does(tok, text, pieces):
    """The file's pre-tokenizer is "smollm": every digit is split off *before* GPT-2's regex runs
    (llama.cpp; SmolLM2's own tokenizer.json has Digits(individual) then ByteLevel), so a whitespace
    run before a digit stays one token. transformers' GGUF loader ignores tokenizer.ggml.pre here and
    gives ["Ġ", "Ġ", "1"] for "  1" instead: the one place we deliberately differ from it."""
    assert [tok.id_to_token(i) for i in tok.encode(text)] == pieces


def test_special_tokens_in_text_map_to_their_ids(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("a<|im_end|>b")[1] == 2
    assert tok.decode(tok.encode("a<|im_end|>b")) == "ab"


def test_special_and_stop_ids(tok, ref):
    assert tok.vocab_size == 49152 == len(ref)
    assert tok.eos_token_id == 2 == ref.eos_token_id
    assert tok.bos_token_id == ref.bos_token_id == 1
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.stop_token_ids[0] == 2
    assert set(tok.stop_token_ids) == {2, tok.token_to_id("<|endoftext|>")}
    assert tok.id_to_token(2) == "<|im_end|>"


# ----- chat template -----

@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok, ref, messages):
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(messages) == expected
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == ref.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=False)


def test_default_system_prompt_is_injected(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.chat_template is not None and "SmolLM" in tok.chat_template


def test_content_parts_are_joined(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "one\ntwo"}])


@pytest.mark.parametrize(("messages", "field"), [
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": 3}], r"messages\[1\]\.content"),
    ([{"role": "user", "content": "ok"}, {"role": "user"}], r"messages\[1\]\.content"),
    ([{"content": "no role"}], r"messages\[0\]\.role"),
    ([{"role": 7, "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\]\.content\[0\]"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], r"messages\[0\]\.content\[0\]\.text"),
    (["just a string"], r"messages\[0\]"),
    ([], r"messages must not be empty"),
    ("hello", r"messages must be a list"),
])
def test_invalid_messages_name_the_field(tok, messages, field):
    with pytest.raises(ValueError, match=field):
        tok.apply_chat_template(messages)


# Templates exercising the environment transformers sets up; rendered by both and compared.
CUSTOM_TEMPLATES = [
    "{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}{{ eos_token }}{% endfor %}",
    "{% for m in messages %}\n  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
    "  [{{ m.role }}] {{ m.content }}\n{% if loop.index > 1 %}{% break %}{% endif %}\n{% endfor %}\n"
    "{% if add_generation_prompt %}  [assistant]{% endif %}",
    "{{ messages | tojson(indent=2) }}",
]


@pytest.mark.parametrize("source", CUSTOM_TEMPLATES)
def test_custom_template_environment_matches_transformers(tok, ref, source):
    messages = [{"role": "system", "content": "<sys & 'q'>"}, {"role": "user", "content": "héllo \"x\""},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    expected = ref.apply_chat_template(messages, chat_template=source, add_generation_prompt=True, tokenize=False)
    variables = {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
    assert ChatTemplate(source, variables).render(messages) == expected


def test_template_raise_exception_becomes_value_error():
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}", {})
    with pytest.raises(ValueError, match="user first"):
        template.render([{"role": "assistant", "content": "x"}])


def test_template_with_syntax_error_is_refused():
    with pytest.raises(ValueError, match="invalid chat template"):
        ChatTemplate("{% for m in messages %}", {})


def test_template_sandbox_blocks_escapes():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(ValueError, match="attribute '__class__' of 'list' object is unsafe") as caught:
        template.render([{"role": "user", "content": "x"}])
    assert isinstance(caught.value.__cause__, SecurityError)    # the sandbox refused, not some other failure


# ----- incremental detokenizer -----

def _stream(tok: Tokenizer, ids: list[int], chunk: int, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return [*pieces, detok.flush()]


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_streamed_text_equals_full_decode(tok, text, chunk):
    ids = tok.encode(text)
    pieces = _stream(tok, ids, chunk)
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # partial characters were held back


def test_streaming_random_ids_equals_full_decode(tok):
    """Random ids include stray byte tokens that never form a character: U+FFFD in the middle of
    the text must come out exactly where a full decode puts it."""
    rng = random.Random(99)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            assert "".join(_stream(tok, ids, 1, skip_special_tokens=skip)) == tok.decode(ids, skip), ids


def test_multibyte_character_is_held_until_complete(tok):
    ids = tok.encode("🎉")
    assert len(ids) > 1  # byte-level BPE splits this emoji
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]
    assert detok.flush() == ""


def test_unfinished_character_comes_out_on_flush(tok):
    ids = tok.encode("ok\n🎉")  # ok, \n, then three tokens for the emoji's four bytes
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([i]) for i in ids[:-1]) == "ok\n"
    held = detok.flush()
    assert held and set(held) == {"\ufffd"}
    assert detok.flush() == ""


def test_prompt_context_keeps_leading_space(tok):
    prompt, completion = tok.encode("The answer is"), tok.encode(" forty two")
    pieces = _stream(tok, completion, 1, prompt_token_ids=prompt)
    assert "".join(pieces) == " forty two"
    assert pieces[0] == " forty"


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("done<|im_end|>")
    assert "".join(_stream(tok, ids, 1)) == "done"
    assert "".join(_stream(tok, ids, 1, skip_special_tokens=False)) == "done<|im_end|>"


# ----- Hugging Face directory -----

def test_from_hf_dir_matches_gguf_tokenizer(tok, ref, tmp_path):
    ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)
    assert hf.eos_token_id == 2 and set(hf.stop_token_ids) == {0, 2}
    assert hf.apply_chat_template(CONVERSATIONS[2]) == tok.apply_chat_template(CONVERSATIONS[2])


def test_from_hf_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ----- SentencePiece-style ("llama") GGUF vocabulary, on a tiny file written here -----

SPM_PIECES = ["h", "e", "l", "o", "w", "r", "d", "▁h", "▁he", "ll", "llo", "▁hello", "▁w", "or", "▁wor",
              "ld", "▁world", SPM_SPACE]


@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory) -> Tokenizer:
    """Llama-2-style vocabulary: <unk>/<s>/</s>, 256 byte tokens, scored pieces and no merges
    (so they are derived from the scores), BOS added by default."""
    import gguf
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES)]
    scores = [0.0] * 259 + [float(i) for i in range(len(SPM_PIECES))]  # longer pieces merge first
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Tokenizer.from_gguf(path)


def test_spm_encodes_with_space_prefix_and_bos(spm_tok):
    ids = spm_tok.encode("hello world")
    assert [spm_tok.id_to_token(i) for i in ids] == ["▁hello", "▁world"]
    assert spm_tok.encode("hello world", add_special_tokens=True) == [1, *ids]
    assert spm_tok.decode(ids) == "hello world"


def test_spm_falls_back_to_bytes(spm_tok):
    ids = spm_tok.encode("héllo\n")
    assert [spm_tok.id_to_token(i) for i in ids] == ["▁h", "<0xC3>", "<0xA9>", "llo", "<0x0A>"]
    assert spm_tok.decode(ids) == "héllo\n"


def test_spm_special_ids_and_template(spm_tok):
    assert (spm_tok.bos_token_id, spm_tok.eos_token_id, spm_tok.stop_token_ids) == (1, 2, (2,))
    assert spm_tok.decode([1, *spm_tok.encode("hello"), 2]) == "hello"
    assert spm_tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi</s>"


def test_spm_detokenizer_keeps_the_space_after_the_prompt(spm_tok):
    prompt, completion = spm_tok.encode("hello"), spm_tok.encode("world hello")
    assert spm_tok.decode(completion) == "world hello"  # the first piece's space is dropped alone
    assert "".join(_stream(spm_tok, completion, 1, prompt_token_ids=prompt)) == " world hello"
    assert "".join(_stream(spm_tok, completion, 1)) == "world hello"
