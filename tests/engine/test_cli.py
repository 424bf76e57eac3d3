"""`tandem complete` / `model fetch` as a user runs them: stdout holds only the completion."""

import subprocess
import sys
from pathlib import Path

import pytest

from shared.engine import SamplingParams

TANDEM = [str(Path(sys.executable).with_name("tandem"))]  # the installed console script


def tandem(*args, stdin=None):
    return subprocess.run([*TANDEM, *args], capture_output=True, text=True, input=stdin, timeout=300)


def test_complete_prints_only_the_completion(smollm2_gguf):
    r = tandem("complete", "--chat", "--temperature", "0", "--max-tokens", "16", "--model", str(smollm2_gguf),
               "--dtype", "float32", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The capital of France is Paris.\n"
    assert "KV cache:" in r.stderr  # logs go to stderr


def test_complete_with_int8_linear_layers(smollm2_gguf):
    # not "What is the capital of France?": float32 itself puts "The" only 0.08 logits above "L"
    # there, inside int8's noise; here the margin is 1.4
    r = tandem("complete", "--chat", "--temperature", "0", "--max-tokens", "16", "--model", str(smollm2_gguf),
               "--quantization", "int8", "Name the capital of France.")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "with int8 linear layers" in r.stderr


def test_complete_without_dtype_logs_the_automatic_precision_and_its_reason(smollm2_gguf):
    from kernels.cpu_features import cpu_flags
    from shared.model.precision import choose_precision

    want = choose_precision("cpu", None, None, cpu_flags())
    r = tandem("complete", "--chat", "--temperature", "0", "--max-tokens", "8", "--model", str(smollm2_gguf),
               "--device", "cpu", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    suffix = "" if want.quantization == "none" else f" + {want.quantization}"
    assert f"precision {want.dtype}{suffix} on cpu: {want.reason}" in r.stderr


def test_complete_reads_stdin_and_honours_seed(smollm2_gguf):
    args = ("complete", "--temperature", "1.0", "--seed", "3", "--max-tokens", "12", "--model", str(smollm2_gguf), "-")
    a, b = tandem(*args, stdin="Once upon a time"), tandem(*args, stdin="Once upon a time")
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.strip()


@pytest.mark.parametrize("args,needle", [
    (("--model", "no-such-model", "hi"), "no-such-model"),
    (("--temperature", "-1", "hi"), "temperature"),
    (("--top-p", "0", "hi"), "top_p"),
    (("--max-model-len", "16", "a b c d e f g h i j k l m n o p q r s t u v w x y z"), "prompt has"),
    (("--max-model-len", "8", "hi"), "max_model_len"),
    (("--kv-cache-memory", "lots", "hi"), "cannot parse size"),
    (("--quantization", "int4", "hi"), "--quantization"),
])
def test_bad_input_is_one_clear_line_without_traceback(args, needle, smollm2_gguf):
    r = tandem("complete", *args)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_model_fetch_prints_the_cached_path(smollm2_gguf):
    r = tandem("model", "fetch")
    assert r.returncode == 0 and r.stdout.strip() == str(smollm2_gguf)


@pytest.mark.parametrize("cmd", [(), ("complete",), ("chat",), ("model", "fetch")])
def test_every_command_has_help(cmd):
    r = tandem(*cmd, "--help")
    assert r.returncode == 0 and "usage: tandem" in r.stdout


def test_chat_keeps_history_and_exits_on_eof(smollm2_gguf, make_engine, smol_tokenizer):
    turns = ["My name is Ada.", "What is my name?"]
    r = tandem("chat", "--temperature", "0", "--max-tokens", "24", "--model", str(smollm2_gguf), "--dtype", "float32",
               stdin="\n".join(turns) + "\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    replies = [part.strip() for part in r.stdout.split("> ") if part.strip()]
    assert len(replies) == 2
    # the second reply is the greedy continuation of the whole two-turn conversation
    history = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": replies[0]},
               {"role": "user", "content": turns[1]}]
    prompt = smol_tokenizer.encode(smol_tokenizer.apply_chat_template(history))
    (expected,) = make_engine().generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))
    assert replies[1] == smol_tokenizer.decode(expected).strip()


def test_num_threads_sets_torch_threads_for_the_engine_process(smollm2_gguf):
    code = ("import torch; from shared.engine import EngineConfig, LLMEngine;"
            f"LLMEngine.from_config(EngineConfig(model={str(smollm2_gguf)!r}, num_threads=1, kv_cache_memory=1 << 24));"
            "print(torch.get_num_threads())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"
