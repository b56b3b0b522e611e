"""`make export`: trained models as Hugging Face model directories (remote code, safetensors, tokenizer)."""
