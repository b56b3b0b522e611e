"""Configuration of a Fast-ELECTRA encoder exported by the fast-electra project (`make export`).

Remote code for `trust_remote_code=True`: it travels inside the model directory and imports
transformers only. The fields are the ones the encoder reads (fast_electra_encoder.py, a verbatim copy
of the project's common/model.py) plus what Hugging Face heads use. Written for transformers 5, whose
configs are dataclasses built from these annotated defaults.
"""
from transformers import PretrainedConfig


class FastElectraConfig(PretrainedConfig):
    """Pre-LN transformer encoder with one T5 relative-position bias shared by all layers (Fast-ELECTRA,
    section 4.1: BERT-sized layers with T5 relative position bias)."""

    model_type = "fast-electra"
    # the names other tools look for, read and written through ours
    attribute_map = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
                     "intermediate_size": "ffn_size", "hidden_dropout_prob": "dropout"}

    vocab_size: int = 8000
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    ffn_size: int = 1024
    rel_buckets: int = 32
    rel_max_distance: int = 128
    rel_bias_locality: float = 0.0
    dropout: float = 0.1
    classifier_dropout: float | None = None
    initializer_range: float = 0.02
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = True
