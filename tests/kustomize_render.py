"""A small kustomize renderer for compose/k8s, so that its tests need neither kubectl nor a network.

It handles exactly the features compose/k8s uses and refuses every other kustomization field, so
that a manifest using more than it models fails here instead of being rendered wrongly:
- ``resources``: YAML files (several documents each) and directories holding a kustomization;
- ``patches`` with a ``path`` only: one strategic merge patch per file (what every kustomize
  takes), naming its target by apiVersion, kind and metadata.name. Maps merge key by key; the lists Kubernetes merges by a
  key (containers and env by name, volumeMounts by mountPath, ...) merge by that key; every other
  list, and every scalar, is replaced. No ``$patch`` directives;
- ``secretGenerator`` from ``envs`` files and ``configMapGenerator`` from ``files`` and
  ``literals``, with ``generatorOptions.disableNameSuffixHash: true`` (required: name hashes
  are not modelled).

    python tests/kustomize_render.py compose/k8s/overlays/cpu   # prints what kubectl apply -k would send
"""

from __future__ import annotations

import base64
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "patches", "secretGenerator", "configMapGenerator",
                "generatorOptions"}
# patchMergeKey of the lists Kubernetes merges (the strategic merge patch of core/v1 and apps/v1)
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name"}


class KustomizeError(ValueError):
    pass


def object_id(obj: dict) -> tuple[str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


def render(directory: str | Path) -> list[dict]:
    """The objects ``kubectl kustomize directory`` would print, in the order of their sources."""
    root = Path(directory)
    kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_FIELDS
    if unknown:
        raise KustomizeError(f"{root}: kustomization fields this renderer does not model: {sorted(unknown)}")
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = root / entry
        objects += render(path) if path.is_dir() else load_documents(path)
    objects += generated(root, kustomization)
    by_id: dict[tuple[str, str, str], dict] = {}
    for obj in objects:
        if object_id(obj) in by_id:
            raise KustomizeError(f"{root}: {object_id(obj)} defined twice")
        by_id[object_id(obj)] = obj
    for patch_entry in kustomization.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise KustomizeError(f"{root}: only patches with a path are modelled, not {patch_entry}")
        patches = load_documents(root / patch_entry["path"])
        if len(patches) != 1:
            raise KustomizeError(f"{root}: {patch_entry['path']} holds {len(patches)} patches, not one")
        target = by_id.get(object_id(patches[0]))
        if target is None:
            raise KustomizeError(f"{root}: patch target {object_id(patches[0])} does not exist")
        merged = strategic_merge(target, patches[0])
        target.clear()
        target.update(merged)
    return objects


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def generated(root: Path, kustomization: dict) -> list[dict]:
    generators = kustomization.get("secretGenerator", []) + kustomization.get("configMapGenerator", [])
    if generators and not kustomization.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise KustomizeError(f"{root}: generated names get a hash suffix; this renderer needs "
                             "generatorOptions.disableNameSuffixHash: true")
    objects = []
    for gen in kustomization.get("secretGenerator", []):
        unknown = set(gen) - {"name", "envs"}
        if unknown:
            raise KustomizeError(f"{root}: secretGenerator fields not modelled: {sorted(unknown)}")
        data = {k: base64.b64encode(v.encode()).decode() for f in gen["envs"] for k, v in env_file(root / f).items()}
        objects.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]},
                        "type": "Opaque", "data": data})
    for gen in kustomization.get("configMapGenerator", []):
        unknown = set(gen) - {"name", "files", "literals"}
        if unknown:
            raise KustomizeError(f"{root}: configMapGenerator fields not modelled: {sorted(unknown)}")
        data = {Path(f).name: (root / f).read_text() for f in gen.get("files", [])}
        data.update(literal.split("=", 1) for literal in gen.get("literals", []))
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    return objects


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and # comments skipped (kustomize's envs format)."""
    pairs = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            if "=" not in line:
                raise KustomizeError(f"{path}: not KEY=VALUE: {line!r}")
            key, value = line.split("=", 1)
            pairs[key] = value
    return pairs


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if isinstance(key, str) and key.startswith("$"):
                raise KustomizeError(f"patch directive {key} is not modelled")
            merged[key] = strategic_merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        merged = copy.deepcopy(base)
        index = {item[key]: i for i, item in enumerate(merged)}
        for item in patch:
            if item[key] in index:
                merged[index[item[key]]] = strategic_merge(merged[index[item[key]]], item)
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(patch)


if __name__ == "__main__":
    print(yaml.safe_dump_all(render(sys.argv[1]), sort_keys=False), end="")
