"""Shared load-testing code: workloads, open-loop runners, stats, reports, trace replay and helpers."""
