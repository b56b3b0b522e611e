"""Stage 1: the offline corpus generator (`python -m generate`), a Ray job."""
