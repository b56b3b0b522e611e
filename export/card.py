"""The model card (README.md) of an export: what the model is, how it was pre-trained, how to load it.

Every figure comes from the run's own files (checkpoint, summary.json, the data manifest, aux.json);
a fact that is not known is said to be unknown, never estimated.
"""
from __future__ import annotations

from pathlib import Path

PAPER = "Fast-ELECTRA for Efficient Pre-training (Dong et al., ICLR 2024)"
METRICS = (("loss", "RTD loss"), ("accuracy", "accuracy"), ("recall", "recall (replaced tokens)"),
           ("precision", "precision (replaced tokens)"), ("auc", "AUC"))


def _fmt(value) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _loading(kind: str, folder: str) -> str:
    auto = "AutoModelForPreTraining" if kind == "rtd" else "AutoModelForMaskedLM"
    path = f"path/to/{folder}"
    return f"""```python
from transformers import AutoModel, AutoTokenizer, {auto}, AutoModelForSequenceClassification

tokenizer = AutoTokenizer.from_pretrained("{path}", trust_remote_code=True)  # reads config.json first
encoder = AutoModel.from_pretrained("{path}", trust_remote_code=True)          # last_hidden_state
model = {auto}.from_pretrained("{path}", trust_remote_code=True)
classifier = AutoModelForSequenceClassification.from_pretrained("{path}", trust_remote_code=True, num_labels=2)
batch = tokenizer(["A sentence.", "Another, longer sentence."], padding=True, return_tensors="pt")
print(model(**batch).logits.shape)
```"""


def _tokenizer_lines(tok: dict) -> list[str]:
    if tok["kind"] == "hf":
        return [f"- Tokenizer: the Hugging Face tokenizer of the auxiliary model `{tok['source']}` ({tok['class']}, "
                f"{tok['size']:,} entries), its files copied unchanged but for `model_max_length` (the rows "
                f"trained on); the embedding rows are in its native ids."]
    return [f"- Tokenizer: the project's cased SentencePiece BPE ({tok['size']:,} pieces, byte fallback) as a "
            f"`tokenizers` BPE in the model's ids (`tokenizer.json`); `tokenizer(text)` gives "
            f"`[CLS] ... [SEP]`. A `[MASK]` written in the text is the mask token, tokenized as SentencePiece does "
            f"(a space before it becomes a `▁` piece of its own; a text of `[MASK]` alone gets no `▁`); a written "
            f"`[CLS]`, `[SEP]`, `[PAD]` or `[UNK]` is read as that token, where SentencePiece spelled it out."]


def card_title(trained) -> str:
    """What the model is, not where it was written (`make export` writes to RUN/hf: a card titled "hf" said
    nothing): the manifest's name, and for a main model its run folder and updates."""
    facts = trained.facts
    preset = facts.get("manifest_name") or "fast-electra"
    if trained.kind == "rtd":
        return f"Fast-ELECTRA {preset}: main model of run {Path(facts['run_dir']).name}, {facts['steps']:,} updates"
    return f"Fast-ELECTRA {preset}: auxiliary masked LM"


def model_card(trained, config: dict, tok: dict, parameters: int, name: str, folder: str) -> str:
    facts = trained.facts
    shape = (f"{config['num_layers']} layers x {config['hidden_size']} hidden, {config['num_heads']} heads, "
             f"FFN {config['ffn_size']}, T5 relative-position bias ({config['rel_buckets']} buckets, max distance "
             f"{config['rel_max_distance']}) shared by all layers, pre-LN; {parameters / 1e6:.2f}M parameters")
    what = ("the main model (discriminator) of a Fast-ELECTRA run: a replaced-token detector, one logit per token"
            if trained.kind == "rtd" else
            "the project's auxiliary masked LM (the frozen model whose samples Fast-ELECTRA's main model learns to "
            "detect); it can serve again as an auxiliary model: `[aux] source = \"hf:DIR\"`")
    lines = ["---", "library_name: transformers", "tags:", "- fast-electra", "- electra",
             f"- {'replaced-token-detection' if trained.kind == 'rtd' else 'fill-mask'}", "---", "",
             f"# {name}", "", f"This is {what}, pre-trained with the fast-electra project ({PAPER}) and exported "
             f"by `make export`.", "",
             "## Architecture", "", f"- {shape}.",
             f"- Trained on rows of at most {trained.max_seq_len} tokens (`[CLS] ... [SEP]`); the relative bias "
             f"has no fixed length, but longer inputs are outside what it saw.",
             *_tokenizer_lines(tok),
             "- Remote code (`trust_remote_code=True`, transformers >= 5): `modeling_fast_electra.py`, "
             "`configuration_fast_electra.py`, and `fast_electra_encoder.py`, a verbatim copy of the project's "
             "`common/model.py` (the trainer's own math).", "",
             "## Pre-training", "",
             "| | |", "|---|---|",
             f"| manifest | `{_fmt(facts.get('manifest_name'))}` |",
             f"| corpus | {_fmt(facts.get('corpus'))} |",
             f"| source | `{facts['checkpoint']}` (sha256 `{facts['checkpoint_sha256'][:16]}`) |"]
    if trained.kind == "rtd":
        tokens = facts["tokens_seen"]
        token_text = (f"{tokens:,} (from the data manifest in `{facts['data_dir']}`)" if tokens is not None else
                      f"unknown (`{facts['data_dir']}` does not hold the stream this checkpoint was trained on)")
        temps = facts.get("temperature_consumed")
        lines += [f"| objective | `{facts['objective']}` |",
                  f"| updates | {facts['steps']:,} of {facts['batch_size']} rows (peak lr {facts['lr']}) |",
                  f"| rows seen | {facts['rows_seen']:,} |",
                  f"| tokens seen | {token_text} |"]
        if temps:
            lines.append(f"| sampling temperatures consumed | {temps[0]:.4f} .. {temps[1]:.4f} |")
        lines += ["", f"Validation on held-out rows (T = 1; metrics from {facts['metrics_from']}); step 0 is the "
                  "base rate, every token called original:", ""]
        start, final = facts.get("validation_start") or {}, facts.get("validation_final") or {}
        lines += [f"| | step {_fmt(start.get('step'))} | step {_fmt(final.get('step'))} |", "|---|---|---|"]
        lines += [f"| {label} | {_fmt(start.get(key))} | {_fmt(final.get(key))} |" for key, label in METRICS]
    else:
        metrics = facts.get("metrics") or {}
        start, end = metrics.get("start") or {}, metrics.get("end") or {}
        lines += [f"| MLM updates | {_fmt(facts.get('steps'))} of {_fmt(facts.get('batch_size'))} rows |", "",
                  "Validation MLM (masked positions of held-out rows, `make aux`):", "",
                  "| | start | end |", "|---|---|---|",
                  f"| loss | {_fmt(start.get('mlm_loss'))} | {_fmt(end.get('mlm_loss'))} |",
                  f"| top-1 | {_fmt(start.get('mlm_top1'))} | {_fmt(end.get('mlm_top1'))} |"]
    lines += ["", "## Loading", "", _loading(trained.kind, folder), "",
              "Fine-tuning with the Hugging Face `Trainer`: see the project's docs/export.md.", ""]
    return "\n".join(lines)
