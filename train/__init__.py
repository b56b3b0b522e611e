"""Stage 2: the trainer (`python -m train` under torchrun) and its objectives."""
