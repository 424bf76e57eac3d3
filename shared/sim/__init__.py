"""Discrete-event simulation of a prefill/decode cluster, driven by the policies in shared.policy.

traces.py     Poisson, gamma-bursty and Mooncake JSONL traces
workers.py    a simulated worker (virtual step counter for decode, prefix cache)
simulator.py  the event loop: routing, admission, conditional disaggregation, autoscaling
report.py     goodput, SLO attainment, percentiles, utilisation PNG, cost
"""
