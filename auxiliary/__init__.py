"""The aux stage: train the auxiliary masked LM (`python -m auxiliary`, `make aux`)."""
