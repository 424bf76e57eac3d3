"""Benchmarks; most time a feature against a baseline measured in the same run and print the ratio."""
