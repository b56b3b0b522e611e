"""Experiments on top of the stages: `make reproduce`, `make sweep`, short ablations."""
