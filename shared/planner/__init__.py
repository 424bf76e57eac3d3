"""Placement planner for prefill/decode serving on heterogeneous GPU clusters (after HexGen-2).

config.py     cluster / model / workload / SLO inputs (pydantic, YAML)
costmodel.py  the one cost model: prefill, decode step, KV transfer, per-phase capacity, calibration
devices.py    the cluster as GPUs and as a weighted device graph
partition.py  spectral bisection + Kernighan-Lin (networkx) into groups
flow.py       per-group evaluation and the preflow-push max-flow from prefill to decode groups
search.py     phase assignment and refinement (flip, exchange, split, merge, swap, move)
exhaustive.py the reference optimum for clusters of up to 8 GPUs
plan.py       the output (workers, routes, predictions, cost) and ``make_plan``
"""
