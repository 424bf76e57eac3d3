"""Planner inputs: cluster, model, workload and SLOs, validated by pydantic and loaded from YAML.

A cluster file names GPU types (with their datasheet figures and price) and nodes that hold a
count of one type; links are given per node (intra-node) and once for the fabric (inter-node).
Models and workloads are either YAML files or one of the presets below.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GpuType(_Strict):
    tflops_bf16: float = Field(gt=0, description="dense bf16 TFLOP/s")
    hbm_gib: float = Field(gt=0)
    hbm_gbps: float = Field(gt=0, description="HBM bandwidth, GB/s")
    price_per_hour: float = Field(ge=0)


class Node(_Strict):
    name: str
    gpu_type: str
    num_gpus: int = Field(ge=1, le=64)
    intra_gbps: float = Field(gt=0, description="per-GPU intra-node bandwidth (NVLink or PCIe), GB/s")
    memory_gbps: float | None = Field(None, gt=0, description="what the node's devices read from memory together "
                                      "per second, where they share it (the cores of a CPU); unset: each its own")


class ClusterSpec(_Strict):
    gpu_types: dict[str, GpuType]
    nodes: list[Node] = Field(min_length=1)
    inter_node_gbps: float = Field(gt=0, description="per-GPU inter-node bandwidth, GB/s")

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"nodes: duplicate node names in {names}")
        for node in self.nodes:
            if node.gpu_type not in self.gpu_types:
                raise ValueError(f"nodes[{node.name}].gpu_type {node.gpu_type!r} is not one of "
                                 f"gpu_types {sorted(self.gpu_types)}")
        return self

    @property
    def num_gpus(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    def price_per_hour(self) -> float:
        return sum(n.num_gpus * self.gpu_types[n.gpu_type].price_per_hour for n in self.nodes)


class ModelSpec(_Strict):
    name: str
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    num_params: float = Field(gt=0)
    bytes_per_param: float = Field(default=2.0, gt=0)
    kv_bytes_per_elem: float = Field(default=2.0, gt=0)
    act_bytes_per_elem: float = Field(default=2.0, gt=0)  # activations between ranks and stages (float32: 4)

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    def kv_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem


class RequestClass(_Strict):
    name: str
    fraction: float = Field(gt=0)
    input_len: int = Field(ge=1)
    output_len: int = Field(ge=1)


class Slo(_Strict):
    ttft_s: float = Field(gt=0)
    tpot_s: float = Field(gt=0)


class WorkloadSpec(_Strict):
    """Request rate plus either mean lengths (lognormal spread ``length_cv``) or request classes."""

    request_rate: float = Field(gt=0, description="requests per second offered")
    input_len: int | None = Field(default=None, ge=1)
    output_len: int | None = Field(default=None, ge=1)
    length_cv: float = Field(default=0.5, ge=0)
    classes: list[RequestClass] | None = None
    slo: Slo

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        has_means = self.input_len is not None and self.output_len is not None
        if has_means == bool(self.classes):
            raise ValueError("give either input_len and output_len, or classes (not both)")
        return self

    def class_mix(self) -> list[RequestClass]:
        """The workload as weighted classes (one class when means are given), fractions summing to 1."""
        if not self.classes:
            return [RequestClass(name="all", fraction=1.0, input_len=self.input_len,
                                 output_len=self.output_len)]
        total = sum(c.fraction for c in self.classes)
        return [c.model_copy(update={"fraction": c.fraction / total}) for c in self.classes]

    def tail_input_len(self) -> float:
        """A long prompt the TTFT SLO must still hold for: the longest class, or the lognormal's
        90th percentile."""
        if self.classes:
            return float(max(c.input_len for c in self.classes))
        if self.length_cv == 0:
            return float(self.input_len)
        sigma = math.sqrt(math.log1p(self.length_cv**2))
        return self.input_len * math.exp(1.2816 * sigma - sigma**2 / 2)

    def mean_lengths(self) -> tuple[float, float]:
        mix = self.class_mix()
        return (sum(c.fraction * c.input_len for c in mix), sum(c.fraction * c.output_len for c in mix))


MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama-2-70b": ModelSpec(name="llama-2-70b", num_layers=80, hidden_size=8192, num_heads=64,
                             num_kv_heads=8, vocab_size=32000, num_params=69e9),
    "llama-2-7b": ModelSpec(name="llama-2-7b", num_layers=32, hidden_size=4096, num_heads=32,
                            num_kv_heads=32, vocab_size=32000, num_params=6.7e9),
    "opt-30b": ModelSpec(name="opt-30b", num_layers=48, hidden_size=7168, num_heads=56,
                         num_kv_heads=56, vocab_size=50272, num_params=30e9),
    "smollm2-135m": ModelSpec(name="smollm2-135m", num_layers=30, hidden_size=576, num_heads=9,
                              num_kv_heads=3, vocab_size=49152, num_params=135e6),
}

# HexGen-2's four workload classes: long/short prompt x long/short output.
_CLASS_LENGTHS = {"lpld": (2048, 512), "lpsd": (2048, 64), "spld": (256, 512), "spsd": (256, 64)}


def preset_workload(name: str, request_rate: float = 10.0, slo: Slo | None = None) -> WorkloadSpec:
    slo = slo or Slo(ttft_s=5.0, tpot_s=0.1)
    if name in _CLASS_LENGTHS:
        inp, out = _CLASS_LENGTHS[name]
        return WorkloadSpec(request_rate=request_rate, input_len=inp, output_len=out, slo=slo)
    if name == "mixed":
        classes = [RequestClass(name=k, fraction=0.25, input_len=i, output_len=o)
                   for k, (i, o) in _CLASS_LENGTHS.items()]
        return WorkloadSpec(request_rate=request_rate, classes=classes, slo=slo)
    raise ValueError(f"unknown workload preset {name!r}; presets: {sorted(_CLASS_LENGTHS) + ['mixed']}")


class PrefillMeasurement(_Strict):
    num_tokens: int = Field(ge=1)
    seconds: float = Field(gt=0)


class DecodeMeasurement(_Strict):
    batch: int = Field(ge=1)
    context_len: int = Field(ge=1)
    seconds: float = Field(gt=0)


class CalibrationSpec(_Strict):
    """Measured step times of ``model`` on one ``gpu`` (e.g. the engine on this machine); the cost
    model's compute and HBM efficiencies are fitted to them (costmodel.calibrate). A calibration
    of tensor-parallel groups (``loadtest.calibrate.parallel``) adds what one device cannot show:
    the fixed cost of a decode step that every rank pays (``step_overhead_s``) and of one collective
    between ranks (``comm_latency_s``; the link's bandwidth is the cluster file's)."""

    model: str
    gpu: GpuType
    prefill: list[PrefillMeasurement] = Field(default_factory=list)
    decode: list[DecodeMeasurement] = Field(default_factory=list)
    step_overhead_s: float = Field(default=0.0, ge=0)
    comm_latency_s: float | None = Field(default=None, ge=0)
    prefill_reads_weights: bool = False  # costmodel.Efficiency's: a prefill also reads the weights once (CPU)
    fit_overheads: bool = False  # costmodel.calibrate's: fit a fixed prefill cost and a per-sequence decode cost too
    # costmodel.calibrate's seq_undivided_s: of the per-sequence decode cost, what a group pays whole
    decode_seq_undivided_s: float | None = Field(default=None, ge=0)
    prefill_overhead_s: float | None = Field(default=None, ge=0)  # measured apart: calibrate keeps it


class ConfigError(ValueError):
    """A config file is missing, unreadable or invalid; the message is one line naming the file."""


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping at top level")
    return data


def validate_spec(cls: type[BaseModel], data: dict, where: str):
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(f"{where}: {loc}: {first['msg'].removeprefix('Value error, ')}{more}") from exc


def load_cluster(path: str | Path) -> ClusterSpec:
    data = load_yaml(path)
    return validate_spec(ClusterSpec, data.get("cluster", data), str(path))


def load_model(name_or_path: str) -> ModelSpec:
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]
    if not Path(name_or_path).exists():
        raise ConfigError(f"model {name_or_path!r} is neither a preset {sorted(MODEL_PRESETS)} "
                          "nor a file")
    data = load_yaml(name_or_path)
    return validate_spec(ModelSpec, data.get("model", data), name_or_path)


def load_workload(name_or_path: str, request_rate: float | None = None) -> WorkloadSpec:
    if not Path(name_or_path).exists():
        try:
            return preset_workload(name_or_path, request_rate or 10.0)
        except ValueError as exc:
            raise ConfigError(f"workload: {exc} (or give a YAML file)") from exc
    data = load_yaml(name_or_path)
    spec = validate_spec(WorkloadSpec, data.get("workload", data), name_or_path)
    return spec.model_copy(update={"request_rate": request_rate}) if request_rate else spec


def load_calibration(path: str | Path) -> CalibrationSpec:
    return validate_spec(CalibrationSpec, load_yaml(path), str(path))
