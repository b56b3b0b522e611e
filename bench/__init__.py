"""Benchmarks (not tests): each writes bench/results/NAME.json and NAME.md."""

