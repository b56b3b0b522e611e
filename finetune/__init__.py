"""The fine-tuning stage: a pre-trained encoder (or a random init) on a GLUE-style task."""
