"""Hugging Face classes over a Fast-ELECTRA encoder exported by the fast-electra project (`make export`).

Remote code for `trust_remote_code=True`: it travels inside the model directory and imports torch,
transformers and its two siblings. The model's math is not here: `fast_electra_encoder.py` is a
verbatim copy of the project's common/model.py (pre-LN layers, one T5 relative-position bias shared by
all layers), so an export computes exactly what the trainer trained.

- `FastElectraModel` (AutoModel): the encoder; last_hidden_state (batch, length, hidden).
- `FastElectraForPreTraining` (AutoModelForPreTraining): + the replaced-token-detection head of the
  Fast-ELECTRA paper (section 2): one logit per token, > 0 = replaced.
- `FastElectraForMaskedLM` (AutoModelForMaskedLM): + the MLM head, output layer tied to the input
  embeddings (an exported auxiliary model; paper section 3 takes the auxiliary model from a previous
  training round or a public repository).
- `FastElectraForSequenceClassification`: ELECTRA's head on the [CLS] state (position 0).
- `FastElectraForTokenClassification`: a linear layer per token.

Per-layer hidden states and attention maps are not returned (the encoder computes them in one pass).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import (BaseModelOutput, MaskedLMOutput, SequenceClassifierOutput,
                                           TokenClassifierOutput)
from transformers.utils import ModelOutput

from .configuration_fast_electra import FastElectraConfig
from .fast_electra_encoder import Encoder, MLMHead, RelativePositionBias, RTDHead


@dataclass
class FastElectraForPreTrainingOutput(ModelOutput):
    """`logits`: (batch, length), > 0 = the token was replaced; `loss`: mean BCE over the scored (label not -100)
    non-padding tokens."""
    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None


def _refuse_extras(output_attentions, output_hidden_states) -> None:
    if output_attentions or output_hidden_states:
        raise ValueError("FastElectra exports return the last hidden state only (no per-layer states or attentions)")


def _result(output: ModelOutput, return_dict: bool | None):
    return output if return_dict is None or return_dict else output.to_tuple()


class FastElectraPreTrainedModel(PreTrainedModel):
    config_class = FastElectraConfig
    base_model_prefix = "fast_electra"
    supports_gradient_checkpointing = False
    _no_split_modules = ["EncoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        """The project's initialisation (common/model.py init_weights) for what a checkpoint does not hold,
        e.g. a new classifier: N(0, initializer_range) matrices, zero biases, unit LayerNorms. The
        `init` functions skip loaded tensors."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            loaded = getattr(module.weight, "_is_hf_initialized", False)
            init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None and not loaded:
                module.weight[module.padding_idx].zero_()
            # The relative-position table's locality prior is applied here, from the table: transformers skips
            # `_init_weights` for a remote-code module with no parameters of its own (RelativePositionBias)
            for owner in self.modules():
                if isinstance(owner, RelativePositionBias) and owner.bias is module and owner.locality > 0:
                    if not loaded:
                        owner.init_locality()
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, MLMHead):
            init.zeros_(module.bias)


class FastElectraModel(FastElectraPreTrainedModel):
    def __init__(self, config: FastElectraConfig):
        super().__init__(config)
        self.encoder = Encoder(config, config.vocab_size, config.num_layers, padding_idx=config.pad_token_id)
        self.post_init()

    def get_input_embeddings(self):
        return self.encoder.embed

    def set_input_embeddings(self, value):
        self.encoder.embed = value

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None):
        """`token_type_ids` is accepted and ignored (one segment embedding: none)."""
        _refuse_extras(output_attentions, output_hidden_states)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.encoder(input_ids, attention_mask)
        return _result(BaseModelOutput(last_hidden_state=hidden), return_dict)


class FastElectraForPreTraining(FastElectraPreTrainedModel):
    def __init__(self, config: FastElectraConfig):
        super().__init__(config)
        self.fast_electra = FastElectraModel(config)
        self.head = RTDHead(config)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None):
        """`labels`: (batch, length), 1 = replaced, -100 = not scored (Hugging Face's convention); the loss is
        the mean BCE over the scored non-padding tokens, as in the project's trainer."""
        _refuse_extras(output_attentions, output_hidden_states)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        logits = self.head(self.fast_electra(input_ids, attention_mask).last_hidden_state)
        loss = None
        if labels is not None:
            keep = attention_mask.bool() & (labels != -100)
            loss = F.binary_cross_entropy_with_logits(logits[keep].float(), labels[keep].float())
        return _result(FastElectraForPreTrainingOutput(loss=loss, logits=logits), return_dict)


class FastElectraForMaskedLM(FastElectraPreTrainedModel):
    # v5 format {tied: source}: the head's output layer is the input embedding table, stored once
    _tied_weights_keys = {"head.embedding.weight": "fast_electra.encoder.embed.weight"}

    def __init__(self, config: FastElectraConfig):
        super().__init__(config)
        self.fast_electra = FastElectraModel(config)
        self.head = MLMHead(config, self.fast_electra.encoder.embed)
        self.post_init()

    def resize_token_embeddings(self, *args, **kwargs):
        """Transformers resizes the (tied) table; the head's output bias follows, new entries at zero."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        old = self.head.bias.data
        bias = torch.zeros(embeddings.num_embeddings, dtype=old.dtype, device=old.device)
        kept = min(old.numel(), bias.numel())
        bias[:kept] = old[:kept]
        self.head.bias = nn.Parameter(bias)
        return embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None):
        """Logits at every position (Hugging Face's convention); `labels` -100 = not scored. The project
        itself applies the head to masked positions only (common/hf.py HFMaskedLM does the same)."""
        _refuse_extras(output_attentions, output_hidden_states)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        logits = self.head(self.fast_electra(input_ids, attention_mask).last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return _result(MaskedLMOutput(loss=loss, logits=logits), return_dict)


class FastElectraClassificationHead(nn.Module):
    """ELECTRA's sentence head on the [CLS] state: dropout, dense, GELU, dropout, projection (the head the
    project's own fine-tuner trains)."""

    def __init__(self, config: FastElectraConfig):
        super().__init__()
        self.dropout = nn.Dropout(config.classifier_dropout if config.classifier_dropout is not None else config.dropout)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.dense(self.dropout(hidden[:, 0])))
        return self.out_proj(self.dropout(x))


def _classification_loss(config, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Regression for one label, single-label cross-entropy for integer labels, else multi-label BCE;
    `config.problem_type` is set on first use, as Hugging Face's own heads do."""
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())
    if config.problem_type == "single_label_classification":
        return F.cross_entropy(logits.float().view(-1, config.num_labels), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


class FastElectraForSequenceClassification(FastElectraPreTrainedModel):
    def __init__(self, config: FastElectraConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.fast_electra = FastElectraModel(config)
        self.classifier = FastElectraClassificationHead(config)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None):
        _refuse_extras(output_attentions, output_hidden_states)
        hidden = self.fast_electra(input_ids, attention_mask).last_hidden_state
        logits = self.classifier(hidden)
        loss = _classification_loss(self.config, logits, labels) if labels is not None else None
        return _result(SequenceClassifierOutput(loss=loss, logits=logits), return_dict)


class FastElectraForTokenClassification(FastElectraPreTrainedModel):
    def __init__(self, config: FastElectraConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.fast_electra = FastElectraModel(config)
        self.dropout = nn.Dropout(config.classifier_dropout if config.classifier_dropout is not None else config.dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None):
        """`labels` (batch, length), -100 = not scored (padding, continuation pieces)."""
        _refuse_extras(output_attentions, output_hidden_states)
        hidden = self.fast_electra(input_ids, attention_mask).last_hidden_state
        logits = self.classifier(self.dropout(hidden))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return _result(TokenClassifierOutput(loss=loss, logits=logits), return_dict)
