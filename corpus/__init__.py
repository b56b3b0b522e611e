"""The corpus stage: raw text -> tokenizer + packed sequences."""
