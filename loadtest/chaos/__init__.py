"""Fault injection: the chaos drill, its faults and report, and the soak run that watches for leaks."""
