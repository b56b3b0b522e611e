"""Fine-tune an export (`make export`) with the Hugging Face `Trainer` on a single-sentence task in the GLUE
TSV layout: the built-in Rotten Tomatoes task by default (docs/export.md). An example of using an export
outside this project: transformers' own classes and loop, none of finetune/.

    python -m finetune.rotten_tomatoes --out work/tasks/rotten_tomatoes      # the task, once (make task)
    python -m export.finetune_hf --model work/tiny/runs/default/hf --task work/tasks/rotten_tomatoes \\
        --out work/tiny/runs/default/hf-rotten-tomatoes [--epochs 3] [--lr 1e-4] [--max-steps N]

Reads `train.tsv` and `dev.tsv` (a `sentence<TAB>label` header, integer labels), trains
`AutoModelForSequenceClassification` (ELECTRA's head on the [CLS] state), reports dev accuracy after every
epoch and writes the fine-tuned model and its tokenizer to --out. Defaults: AdamW, lr 1e-4, batch 32,
3 epochs, 10% warm-up, weight decay 0.01 (points of the paper's appendix grid); the project's own
`make finetune` differs (AdaMax, embedding rows rescaled, a grid over seeds), so its figures are not
these.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def read_task_split(path: Path) -> tuple[list[str], list[int]]:
    """(sentences, labels) of a `sentence<TAB>label` file with a header line; a bad line is named by number."""
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} does not exist (python -m finetune.rotten_tomatoes --out DIR)")
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    numbered = [(n, line.rstrip("\r")) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise ValueError(f"{path} is empty: it needs a 'sentence<TAB>label' header and rows")
    header = numbered[0][1].split("\t")
    if "sentence" not in header or "label" not in header:
        raise ValueError(f"{path}: the header must name 'sentence' and 'label' columns, found {header}")
    text_col, label_col = header.index("sentence"), header.index("label")
    texts, labels = [], []
    for n, line in numbered[1:]:
        row = line.split("\t")
        if len(row) <= max(text_col, label_col):
            raise ValueError(f"{path}:{n} has {len(row)} column(s), the header {len(header)}")
        try:
            labels.append(int(row[label_col]))
        except ValueError:
            raise ValueError(f"{path}:{n}: the label {row[label_col]!r} is not an integer") from None
        texts.append(row[text_col])
    if not texts:
        raise ValueError(f"{path} has a header but no rows")
    return texts, labels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.finetune_hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an export (make export)")
    parser.add_argument("--task", default="work/tasks/rotten_tomatoes", help="folder with train.tsv and dev.tsv")
    parser.add_argument("--out", required=True, help="where the fine-tuned model and the trainer's files go")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128, help="tokens per example, [CLS] and [SEP] included")
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many updates (-1: --epochs)")
    parser.add_argument("--max-train-examples", type=int, default=0, help="use the first N training examples (0: all)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    import torch
    import transformers
    task = Path(args.task)
    try:
        train_texts, train_labels = read_task_split(task / "train.tsv")
        dev_texts, dev_labels = read_task_split(task / "dev.tsv")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.max_train_examples:
        train_texts, train_labels = train_texts[:args.max_train_examples], train_labels[:args.max_train_examples]
    found = sorted(set(train_labels + dev_labels))
    if found[0] < 0:  # the classifier's classes are 0..K-1 (the loss's targets)
        print(f"error: {task}: labels must be 0, 1, ..., found {found[:8]}", file=sys.stderr)
        return 2
    num_labels = found[-1] + 1
    if not (Path(args.model) / "config.json").is_file():
        print(f"error: --model {args.model} is not a model folder (no config.json): pass what `make export` wrote",
              file=sys.stderr)
        return 2

    # the new classifier head's weights are drawn in from_pretrained, before the Trainer seeds: seeded here
    transformers.set_seed(args.seed)
    # trust_remote_code: the export's model code (our encoder) travels in the folder; the tokenizer reads its config
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(args.model, trust_remote_code=True,
                                                                            num_labels=num_labels)

    def encode(texts, labels):
        enc = tokenizer(texts, truncation=True, max_length=args.max_length)
        return [{"input_ids": ids, "attention_mask": mask, "labels": label}
                for ids, mask, label in zip(enc["input_ids"], enc["attention_mask"], labels)]

    def accuracy(prediction) -> dict:
        return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}

    training = transformers.TrainingArguments(
        output_dir=str(Path(args.out) / "trainer"), num_train_epochs=args.epochs, max_steps=args.max_steps,
        learning_rate=args.lr, per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=64,
        warmup_steps=0.1, weight_decay=0.01, eval_strategy="epoch" if args.max_steps < 0 else "no",
        save_strategy="no", logging_steps=50, report_to="none", seed=args.seed,
        dataloader_pin_memory=torch.cuda.is_available())  # pinned host memory serves a GPU only
    trainer = transformers.Trainer(model=model, args=training, train_dataset=encode(train_texts, train_labels),
                                   eval_dataset=encode(dev_texts, dev_labels), compute_metrics=accuracy,
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer))
    result = trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(args.out)
    tokenizer.save_pretrained(args.out)
    summary = {"model": args.model, "task": str(task), "train_examples": len(train_texts), "dev_examples": len(dev_texts),
               "steps": result.global_step, "train_loss": result.training_loss, "dev_accuracy": metrics["eval_accuracy"],
               "dev_loss": metrics["eval_loss"]}
    (Path(args.out) / "finetune_hf.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
