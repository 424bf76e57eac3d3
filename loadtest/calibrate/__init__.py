"""Fitting the simulator's cost model to this machine and checking it against the live stack."""
