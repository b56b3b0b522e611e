"""Shared pieces of Fast-ELECTRA: config, tokenizer, corpus packing, model, curriculum, shards."""
