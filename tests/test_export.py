"""`make export` (export/): a trained run, and our aux model, as Hugging Face model directories.

Offline and small: a 2-layer RTD model saved by the trainer's own checkpoint code (train/state.py) on the
session's tiny corpus; its export loaded back with transformers' Auto classes (remote code) and compared
with common.model on the same ids, fine-tuned with the Hugging Face Trainer, and our aux model taken
through export -> `hf:` aux -> the masked-position logits of our MaskedLM."""
import ast
import contextlib
import dataclasses
import io
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from common.config import save_resolved  # noqa: E402
from common.model import ReplacedTokenDetector  # noqa: E402
from common.optim import build_optimizer, build_scheduler  # noqa: E402
from common.shards import data_fingerprint  # noqa: E402
from common.tokenizer import PAD_ID, open_tokenizer  # noqa: E402
from export.__main__ import main as export_main  # noqa: E402
from export.exporter import export, from_aux, from_run  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from train import state  # noqa: E402

STEPS = 12
METRICS = {"loss": 0.41, "accuracy": 0.86, "recall": 0.02, "precision": 0.31, "auc": 0.637}


def auto(name: str):
    return getattr(transformers, name)


def load(cls: str, folder: Path, **kwargs):
    return auto(cls).from_pretrained(str(folder), trust_remote_code=True, local_files_only=True, **kwargs)


def perturbed_detector(config, vocab_size: int, seed: int = 0) -> ReplacedTokenDetector:
    """A detector whose weights are not at their initial values (LayerNorms included)."""
    torch.manual_seed(seed)
    model = ReplacedTokenDetector(config.model, vocab_size)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def save_run(config, model, run_dir: Path, data_dir: Path | None = None, tokenizer_sha256: str | None = None) -> Path:
    """A run folder as the trainer leaves it: checkpoints/step-XXXXXXXX.pt (train.state.save; the tokenizer hash
    of corpus.json, as the trainer records it, unless given), summary.json (train.trainer.write_summary),
    resolved_manifest.toml; optionally a data manifest it was trained on."""
    from common.corpus import load_corpus_meta
    from train.trainer import write_summary
    if tokenizer_sha256 is None:
        tokenizer_sha256 = load_corpus_meta(config.corpus_dir)["tokenizer_sha256"]
    fingerprint = "no-data-manifest"
    if data_dir is not None:  # two shards of 64 rows: 1000 and 1200 tokens
        manifest = {"generation_key": "k", "valid": {"shards": []}, "epochs": [{"shards": [
            {"path": "epoch-000/shard-00000.parquet", "rows": 64, "sha256": "a", "stream_start": 0, "tokens": 1000},
            {"path": "epoch-000/shard-00001.parquet", "rows": 64, "sha256": "b", "stream_start": 64, "tokens": 1200}]}]}
        data_dir.mkdir(parents=True)
        (data_dir / "manifest.json").write_text(json.dumps(manifest))
        fingerprint = data_fingerprint(manifest)
    optimizer = build_optimizer(model, 1e-3, (0.9, 0.999), 1e-6, 0.01)
    scheduler = build_scheduler(optimizer, 2, STEPS)
    history = {"start": {"step": 0, **METRICS, "auc": 0.5}, "last": {"step": STEPS, **METRICS},
               "temperature_consumed": [1.0, 1.9]}
    state.save(run_dir / "checkpoints", 2, state.Progress(STEPS, history), model, optimizer, scheduler, config,
               fingerprint, 0, 1, torch.device("cpu"), tokenizer_sha256)
    save_resolved(config, run_dir)
    write_summary(run_dir, history, STEPS, 0, 100.0, 0, "cpu", planned_steps=STEPS, corpus=config.corpus.source)
    return run_dir


@pytest.fixture(scope="module")
def exported(built, tmp_path_factory):
    """(config, our detector, export folder) for a run on the session's tiny corpus."""
    root = tmp_path_factory.mktemp("export")
    tok = open_tokenizer(built.corpus_dir)
    model = perturbed_detector(built, tok.vocab_size)
    run = save_run(built, model, root / "run", data_dir=root / "epochs")
    out = export(from_run(run, data=root / "epochs"), root / "hf", log=lambda *a: None)
    return built, model, out


def batch_of(tokenizer, texts: list[str]) -> dict:
    return tokenizer(texts, padding=True, return_tensors="pt")


def corpus_texts(config, count: int = 40) -> list[str]:
    raw = sorted(Path(config.corpus.source).glob("*.txt"))
    lines = [line for p in raw for line in p.read_text().splitlines() if line.strip()]
    return lines[:count]


def test_the_export_holds_weights_config_tokenizer_card_and_remote_code(exported):
    config, _, out = exported
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
            "configuration_fast_electra.py", "modeling_fast_electra.py", "fast_electra_encoder.py"} <= names
    assert not list(out.parent.glob(f".{out.name}*"))  # no staging folder left behind
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes  # model.safetensors too (safetensors writes 0600)
    assert (out / "fast_electra_encoder.py").read_bytes() == (ROOT / "common" / "model.py").read_bytes()
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["model_type"] == "fast-electra" and hf_config["architectures"] == ["FastElectraForPreTraining"]
    assert {"AutoModel", "AutoModelForSequenceClassification", "AutoModelForTokenClassification",
            "AutoModelForPreTraining"} <= hf_config["auto_map"].keys()
    assert (hf_config["num_layers"], hf_config["hidden_size"], hf_config["rel_buckets"]) == (
        config.model.num_layers, config.model.hidden_size, config.model.rel_buckets)
    card = (out / "README.md").read_text()
    assert f"\n# Fast-ELECTRA {config.name}: main model of run run, {STEPS:,} updates\n" in card  # not the folder's name
    for fact in (f"| updates | {STEPS:,} of", "| rows seen | 96 |", "| tokens seen | 1,600 ",  # 1000 + 1200 * 32/64
                 "| AUC | 0.5000 | 0.6370 |", f"`{config.name}`", config.corpus.source, "trust_remote_code=True"):
        assert fact in card, fact
    # the card's own loading code runs, its placeholder path made the folder's
    snippet = card.split("```python\n")[1].split("```")[0]
    assert f'"path/to/{out.name}"' in snippet
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(snippet.replace(f"path/to/{out.name}", str(out)), {})
    assert printed.getvalue().startswith("torch.Size([2, ")


def test_hidden_states_and_rtd_logits_equal_ours_with_padding(exported):
    """... and the RTD loss scores labelled non-padding tokens only (labels -100: not scored)."""
    config, ours, out = exported
    tokenizer = auto("AutoTokenizer").from_pretrained(str(out), trust_remote_code=True)
    batch = batch_of(tokenizer, corpus_texts(config, 6))
    mask = batch["attention_mask"]
    assert (mask == 0).any()  # rows of several lengths: padding in the batch
    keep = mask.bool()
    with torch.no_grad():
        hidden = load("AutoModel", out).eval()(**batch).last_hidden_state
        assert hidden.dtype == torch.float32
        assert (hidden - ours.encoder(batch["input_ids"], mask))[keep].abs().max() <= 1e-5
        detector = load("AutoModelForPreTraining", out).eval()
        logits = detector(**batch).logits
        assert (logits - ours(batch["input_ids"], mask))[keep].abs().max() <= 1e-5
        labels = (torch.arange(mask.numel()).view(mask.shape) % 3 == 0).long()
        labels[:, 1::4] = -100
        labels[~keep] = 1  # padding: never scored, whatever its label
        scored = keep & (labels != -100)
        expected = torch.nn.functional.binary_cross_entropy_with_logits(logits[scored], labels[scored].float())
        assert torch.allclose(detector(**batch, labels=labels).loss, expected)


def _train(model, dataset, collator, tmp_path: Path, steps: int = 8):
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to="none",
                                          max_steps=steps, per_device_train_batch_size=8, learning_rate=2e-3,
                                          logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def test_sequence_and_token_classification_load_and_train_with_the_hf_trainer(exported, tmp_path):
    """The pre-trained encoder loads as it was, the new classifier starts from _init_weights (N(0, 0.02), zero
    bias), and a few HF Trainer steps move both."""
    config, ours, out = exported
    tokenizer = auto("AutoTokenizer").from_pretrained(str(out), trust_remote_code=True)
    texts = corpus_texts(config, 32)
    for cls, make_labels, collator in (
            ("AutoModelForSequenceClassification", lambda enc, t: int("king" in t.lower()),
             transformers.DataCollatorWithPadding(tokenizer)),
            ("AutoModelForTokenClassification", lambda enc, t: [int(i % 2 == 0) for i in enc["input_ids"]],
             transformers.DataCollatorForTokenClassification(tokenizer))):
        model = load(cls, out, num_labels=2)
        assert all(torch.equal(model.fast_electra.encoder.state_dict()[k], v) for k, v in ours.encoder.state_dict().items())
        new_head = model.classifier.out_proj if hasattr(model.classifier, "out_proj") else model.classifier
        assert new_head.bias.detach().abs().max() == 0 and 0.01 < float(new_head.weight.detach().std()) < 0.03
        before = {k: v.clone() for k, v in model.state_dict().items()}
        dataset = []
        for text in texts:
            enc = tokenizer(text)
            dataset.append({**enc, "labels": make_labels(enc, text)})
        losses = _train(model, dataset, collator, tmp_path / cls)
        assert len(losses) == 8 and all(np.isfinite(losses)), (cls, losses)
        after = model.state_dict()
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert any(k.startswith("classifier") for k in changed) and any("encoder.layers" in k for k in changed), cls
        assert min(losses[-3:]) < losses[0], (cls, losses)


def test_our_aux_model_exports_and_comes_back_as_an_hf_aux_with_the_same_logits(built, tmp_path):
    """aux.pt -> export -> `[aux] source = "hf:DIR"`: a corpus tokenized by the export's tokenizer (renumbered
    by common/hf.py), the aux record, load_aux -> HFMaskedLM; logits at masked positions equal our MaskedLM's
    on the same text."""
    from auxiliary.mlm import use_hf_aux
    from common.checkpoint import AUX_FILE, load_aux
    from common.corpus import SplitRows
    from corpus.build import build_corpus
    out = export(from_aux(built.aux_dir / AUX_FILE), tmp_path / "aux-hf", log=lambda *a: None)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["FastElectraForMaskedLM"]
    assert f"\n# Fast-ELECTRA {built.name}: auxiliary masked LM\n" in (out / "README.md").read_text()
    config = dataclasses.replace(built, work_dir=str(tmp_path / "work"), shared_dir="",
                                 aux=dataclasses.replace(built.aux, source=f"hf:{out}"))
    build_corpus(config, config.corpus_dir, workers=1, log=lambda *a: None)
    use_hf_aux(config, config.corpus_dir, config.aux_dir, log=lambda *a: None)
    theirs, _ = load_aux(config.aux_dir / AUX_FILE)
    ours, _ = load_aux(built.aux_dir / AUX_FILE)
    tok = open_tokenizer(config.corpus_dir)  # ids renumbered by frequency; hf_of -> the export's = our old ids
    rows = SplitRows(config.corpus_dir, "valid")
    sample = [torch.from_numpy(rows[i].astype(np.int64)) for i in range(4)]
    ids = torch.nn.utils.rnn.pad_sequence(sample, batch_first=True, padding_value=PAD_ID)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in sample], batch_first=True)
    flags = torch.zeros_like(ids, dtype=torch.bool)
    flags[:, 1:6:2] = True
    hf_of = torch.as_tensor(tok.hf_of)
    with torch.no_grad():
        new = theirs(ids, mask, flags)                    # columns: the new corpus's ids
        old = ours(hf_of[ids], mask, flags)[:, hf_of]     # the same text in the old ids, columns reordered
    assert new.shape == (12, tok.vocab_size)
    assert (new - old).abs().max() <= 1e-5
    mlm = load("AutoModelForMaskedLM", out).eval()  # new entries (added tokens): the tied table and the bias grow
    ids = torch.tensor([[2, 7, 9, 4, 3]])
    with torch.no_grad():
        before = mlm(input_ids=ids).logits
        mlm.resize_token_embeddings(mlm.config.vocab_size + 8)
        after = mlm(input_ids=ids).logits
    assert mlm.head.embedding.weight is mlm.get_input_embeddings().weight and after.shape[-1] == before.shape[-1] + 8
    assert torch.equal(after[..., :before.shape[-1]], before) and mlm.head.bias[-8:].abs().max() == 0


def test_a_run_on_an_hf_tokenizer_exports_with_that_tokenizer_in_native_ids(tmp_path):
    """corpus with an hf: RoBERTa-style aux model (pad id 1) -> a run -> export: the tokenizer files are the
    aux model's, the embedding rows are in its native order, and hidden states equal ours after mapping."""
    from corpus.build import build_corpus
    from tests.conftest import tiny_config, write_text_corpus
    from tests.test_hf import make_model, make_tokenizer
    raw = write_text_corpus(tmp_path / "raw", num_docs=6, seed=3)
    hf_dir = tmp_path / "roberta"
    native = make_tokenizer("roberta", [p.read_text() for p in sorted(raw.glob("*.txt"))], hf_dir)
    make_model("roberta", len(native), native.pad_token_id, hf_dir)
    config = tiny_config(tmp_path / "work")
    config = dataclasses.replace(config, corpus=dataclasses.replace(config.corpus, source=str(raw)),
                                 aux=dataclasses.replace(config.aux, source=f"hf:{hf_dir}"))
    build_corpus(config, config.corpus_dir, workers=1, log=lambda *a: None)
    tok = open_tokenizer(config.corpus_dir)
    ours = perturbed_detector(config, tok.vocab_size, seed=1)
    out = export(from_run(save_run(config, ours, tmp_path / "run")), tmp_path / "hf", log=lambda *a: None)
    assert (out / "tokenizer.json").read_bytes() == (config.corpus_dir / "hf_tokenizer" / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == native.pad_token_id == 1
    exported_tok = auto("AutoTokenizer").from_pretrained(str(out), trust_remote_code=True)
    batch = batch_of(exported_tok, corpus_texts(config, 5))
    assert (batch["attention_mask"] == 0).any()
    native_ids, mask = batch["input_ids"], batch["attention_mask"]
    our_ids = torch.from_numpy(tok.ours_of32[native_ids.numpy()].astype(np.int64))
    keep = mask.bool()
    with torch.no_grad():
        hidden = load("AutoModel", out).eval()(**batch).last_hidden_state
        assert (hidden - ours.encoder(our_ids, mask))[keep].abs().max() <= 1e-5
    model = load("AutoModel", out)
    assert model.encoder.embed.padding_idx == 1
    assert torch.equal(model.encoder.embed.weight[torch.as_tensor(tok.hf_of)], ours.encoder.embed.weight)


def test_bad_input_stops_with_the_path_and_writes_nothing(exported, tmp_path, capsys):
    config, _, out = exported
    empty_run = tmp_path / "run"
    (empty_run / "checkpoints").mkdir(parents=True)
    target = tmp_path / "new-export"
    assert export_main(["--run", str(empty_run), "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert "holds no trainer checkpoint" in err and str(empty_run) in err and "Traceback" not in err
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    run = out.parent / "run"
    assert export_main(["--run", str(run), "--out", str(out)]) == 2  # an existing, non-empty export
    err = capsys.readouterr().err
    assert "exists and is not empty" in err and str(out) in err and "--force" in err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert not list(out.parent.glob(f".{out.name}*"))


def test_a_malformed_aux_pt_and_an_os_error_end_in_one_error_line_naming_the_file(exported, tmp_path, monkeypatch,
                                                                                  capsys):
    import shutil
    import export.exporter as exporter
    from common.checkpoint import AUX_FILE, AUX_META, safe_load
    config, _, out = exported
    payload = safe_load(config.aux_dir / AUX_FILE)
    for name, broken in (("entries", {"format_version": 1, "model_config": payload["model_config"]}),
                         ("weights", {**payload, "state_dict": {"head.bias": payload["state_dict"]["head.bias"]}})):
        aux = tmp_path / name / AUX_FILE
        aux.parent.mkdir()
        torch.save(broken, aux)
        shutil.copyfile(config.aux_dir / AUX_META, aux.with_name(AUX_META))
        assert export_main(["--aux", str(aux), "--out", str(tmp_path / "x"), "--corpus", str(config.corpus_dir)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and f"{aux} is not an aux model" in err, err
    monkeypatch.setattr(exporter, "verify", lambda trained, folder, tf: open(folder / "missing.json"))
    assert export_main(["--run", str(out.parent / "run"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "missing.json" in err, err
    assert f"export of {out.parent / 'run' / 'checkpoints'}" in err and f"to {tmp_path / 'x'} failed" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entries", "weights"]


def test_force_never_replaces_a_folder_the_export_reads(exported, tmp_path, capsys):
    import shutil
    _, _, out = exported
    run = shutil.copytree(out.parent / "run", tmp_path / "run")
    for target in (run, tmp_path):
        assert export_main(["--run", str(run), "--out", str(target), "--force"]) == 2
        assert "holds no config.json" in capsys.readouterr().err  # not a model directory
        (target / "config.json").write_text('{"model_type": "fast-electra"}')  # as if one were: still never replaced
        assert export_main(["--run", str(run), "--out", str(target), "--force"]) == 2
        err = capsys.readouterr().err
        assert f"output folder {target} holds" in err and "which the export reads" in err, err
        assert list((run / "checkpoints").glob("step-*.pt"))


def test_a_checkpoint_trained_on_another_tokenizer_is_refused_naming_both(exported, tmp_path):
    """Runs record corpus.json's tokenizer hash (save_run, as the trainer; every export here passes the check, the
    hf: one included); another hash is refused, an older checkpoint without one exports."""
    config, model, _ = exported
    tok = open_tokenizer(config.corpus_dir)
    run = save_run(config, model, tmp_path / "run", tokenizer_sha256="ab" * 32)
    with pytest.raises(ValueError, match="trained on data made with tokenizer") as error:
        from_run(run)
    for part in (str(run / "checkpoints" / f"step-{STEPS:08d}.pt"), "ab" * 6, tok.sha256[:12], str(tok.path)):
        assert part in str(error.value), (part, str(error.value))
    assert from_run(save_run(config, model, tmp_path / "old", tokenizer_sha256="")).tokenizer.sha256 == tok.sha256


def test_force_replaces_an_export_and_a_missing_extra_names_the_install_command(exported, tmp_path, monkeypatch,
                                                                                capsys):
    config, _, out = exported
    again = tmp_path / "again"
    again.mkdir()
    (again / "stale.txt").write_text("from an earlier export")
    assert export_main(["--run", str(out.parent / "run"), "--out", str(again), "--force",
                        "--data", str(out.parent / "epochs")]) == 2  # not a model directory: never replaced
    assert "holds no config.json" in capsys.readouterr().err and (again / "stale.txt").is_file()
    for other in ('{"model_type": "bert", "architectures": ["BertForMaskedLM"]}', "{}", "not json"):
        (again / "config.json").write_text(other)  # a downloaded model, an hf: aux model: never replaced either
        assert export_main(["--run", str(out.parent / "run"), "--out", str(again), "--force"]) == 2
        err = capsys.readouterr().err
        assert f"output folder {again} holds a model directory that is not an export of this project" in err, err
        assert (again / "stale.txt").is_file() and (again / "config.json").read_text() == other
    (again / "config.json").write_text('{"model_type": "fast-electra"}')  # an earlier export
    assert export_main(["--run", str(out.parent / "run"), "--out", str(again), "--force",
                        "--data", str(out.parent / "epochs")]) == 0
    assert not (again / "stale.txt").exists()
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # no staging or replaced folder left
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if the extra were not installed
    assert export_main(["--run", str(out.parent / "run"), "--out", str(tmp_path / "x")]) == 2
    assert "pip install -e '.[hf]'" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_a_swap_that_fails_puts_the_replaced_folder_back(tmp_path, monkeypatch):
    """common.io.publish_folder, the last step of an export (and of a corpus build): when the finished folder
    cannot be renamed into place, the folder --force was replacing is back under its name."""
    from common.io import publish_folder
    staging, out = tmp_path / ".out.export-tmp", tmp_path / "out"
    for folder, text in ((staging, "new"), (out, "old")):
        folder.mkdir()
        (folder / "file.txt").write_text(text)
    real = Path.rename

    def rename(self, target):
        if self == staging:
            raise OSError(28, "No space left on device", str(self))
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="No space left"):
        publish_folder(staging, out)
    assert (out / "file.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [staging.name, "out"]
    monkeypatch.undo()
    publish_folder(staging, out)
    assert (out / "file.txt").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_common_model_stands_alone_for_the_export():
    """The file copied into every export imports torch and the standard library only, and its [PAD] id is ours;
    the other two remote files import torch, transformers and their siblings only."""
    import common.model
    tree = ast.parse((ROOT / "common" / "model.py").read_text())
    modules = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
               for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
               for a in (n.names if isinstance(n, ast.Import) else [None])}
    assert modules <= {"__future__", "math", "typing", "torch"}, modules
    assert common.model.PAD_ID == PAD_ID
    remote = sorted((ROOT / "common" / "hf_remote").glob("*.py"))
    assert {p.name for p in remote} >= {"configuration_fast_electra.py", "modeling_fast_electra.py"}
    for path in remote:  # the rest of the remote code
        tree = ast.parse(path.read_text())
        absolute = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        absolute |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        siblings = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
        assert absolute <= {"dataclasses", "torch", "transformers"}, (path.name, absolute)
        assert siblings <= {"configuration_fast_electra", "fast_electra_encoder"}, (path.name, siblings)


def test_an_export_whose_code_is_not_ours_is_refused_as_an_hf_aux(exported, tmp_path):
    """common/hf.py runs an export's remote code only when it is this repository's byte for byte."""
    import shutil
    from common import hf
    _, _, out = exported
    assert hf.own_remote_code(out)
    copy = tmp_path / "edited"
    shutil.copytree(out, copy)
    with (copy / "fast_electra_encoder.py").open("a") as f:
        f.write("\nprint('code from elsewhere')\n")
    with pytest.raises(hf.HFError, match="fast_electra_encoder.py is not this repository's"):
        hf.load_hf_tokenizer(copy)


@pytest.mark.parametrize("file, key", [("config.json", "AutoConfig"), ("config.json", "AutoModelForMaskedLM"),
                                       ("tokenizer_config.json", "AutoTokenizer")])
def test_an_export_whose_auto_map_names_other_code_is_refused_before_it_runs(exported, tmp_path, file, key):
    """The three files are ours, but an auto_map entry points at another module in the folder: with
    trust_remote_code transformers would import it, so common/hf.py refuses the folder, naming the file."""
    import shutil
    from common import hf
    _, _, out = exported
    copy = tmp_path / "other-code"
    shutil.copytree(out, copy)
    ran = tmp_path / "ran"
    (copy / "other.py").write_text(f"open({str(ran)!r}, 'w').close()\n"
                                   "from .configuration_fast_electra import FastElectraConfig as Other\n")
    data = json.loads((copy / file).read_text())
    data.setdefault("auto_map", {})[key] = ["other.Other", None] if key == "AutoTokenizer" else "other.Other"
    (copy / file).write_text(json.dumps(data))
    for load_it in (hf.load_config, hf.load_hf_tokenizer, hf.load_masked_lm):
        with pytest.raises(hf.HFError, match=f"{file} maps Auto classes to code that is not this repository's"):
            load_it(copy)
    assert not ran.exists()


def test_an_electra_baseline_run_exports_its_discriminator(built, tmp_path):
    """`[train] objective = "electra"` checkpoints hold generator + discriminator: the export is the
    discriminator, its logits ours."""
    from train.objectives import ElectraPair
    config = dataclasses.replace(built, train=dataclasses.replace(built.train, objective="electra"))
    tok = open_tokenizer(built.corpus_dir)
    torch.manual_seed(2)
    pair = ElectraPair(config.model, tok.vocab_size, config.aux.num_layers).eval()
    out = export(from_run(save_run(config, pair, tmp_path / "run")), tmp_path / "hf", log=lambda *a: None)
    ids = torch.tensor([[2, 7, 9, 11, 3], [2, 8, 3, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        logits = load("AutoModelForPreTraining", out).eval()(input_ids=ids, attention_mask=mask).logits
        assert (logits - pair.discriminator(ids, mask))[mask.bool()].abs().max() <= 1e-5
    assert "| objective | `electra` |" in (out / "README.md").read_text()


def test_a_new_model_from_an_export_config_starts_from_the_locality_prior_and_loads_its_own_table(exported, tmp_path):
    """_init_weights gives what common.model.init_weights gives (the relative-position table with the locality
    prior, a zero [PAD] row), and a saved table is loaded, not re-initialised."""
    from common.model import RelativePositionBias
    _, _, out = exported
    config = auto("AutoConfig").from_pretrained(str(out), trust_remote_code=True)
    config.rel_bias_locality = 1.5
    fresh = auto("AutoModel").from_config(config, trust_remote_code=True)
    expected = RelativePositionBias(config.num_heads, config.rel_buckets, config.rel_max_distance, 1.5)
    expected.init_locality()
    assert torch.equal(fresh.encoder.rel_bias.bias.weight, expected.bias.weight)
    assert fresh.encoder.embed.weight[config.pad_token_id].abs().max() == 0
    with torch.no_grad():
        fresh.encoder.rel_bias.bias.weight.add_(1.0)
    fresh.save_pretrained(str(tmp_path / "saved"))
    assert torch.equal(load("AutoModel", tmp_path / "saved").encoder.rel_bias.bias.weight, fresh.encoder.rel_bias.bias.weight)


@pytest.mark.parametrize("name, change", [
    ("layers.0.ffn_out.weight", lambda w: w + 0.01 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))),
    ("ln_final.bias", lambda b: b + 1e-3 * (torch.arange(b.numel()) == 0))])  # the RTD logit moves by ~1e-5 only
def test_an_export_that_does_not_reproduce_the_model_is_not_published(exported, tmp_path, monkeypatch, name, change):
    """The probe check can fail: weights changed on their way into model.safetensors stop the export, and
    neither the new folder nor the one --force would replace is touched."""
    import export.exporter as exporter
    _, _, out = exported
    real = exporter.hf_weights

    def changed(trained):
        tensors, vocab, pad = real(trained)
        key = next(k for k in tensors if k.endswith("encoder." + name))
        tensors[key] = change(tensors[key])
        return tensors, vocab, pad

    monkeypatch.setattr(exporter, "hf_weights", changed)
    target = tmp_path / "kept"
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "fast-electra"}')  # the previous export
    with pytest.raises(exporter.ExportError, match="does not reproduce it.*nothing was written to " + re.escape(str(target))):
        export(from_run(out.parent / "run", data=out.parent / "epochs"), target, force=True, log=lambda *a: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and [p.name for p in target.iterdir()] == ["config.json"]


def test_the_hf_trainer_example_fine_tunes_an_export_and_names_bad_task_lines(exported, tmp_path, capsys):
    """export/finetune_hf.py as docs/export.md runs it: two updates on a small task, the fine-tuned model and
    its summary written; a malformed task file is one error line naming the file and line, exit code 2."""
    from export import finetune_hf
    config, _, out = exported
    texts = corpus_texts(config, 24)
    task = tmp_path / "task"
    task.mkdir()
    for name, rows in (("train.tsv", texts[:16]), ("dev.tsv", texts[16:])):
        (task / name).write_text("sentence\tlabel\n" + "".join(f"{t}\t{int('king' in t.lower())}\n" for t in rows))
    summaries = []
    for run in ("ft", "ft-again"):  # the same --seed, the same run (the new head's init was the process's draw)
        assert finetune_hf.main(["--model", str(out), "--task", str(task), "--out", str(tmp_path / run),
                                 "--max-steps", "2", "--batch-size", "8"]) == 0
        summaries.append(json.loads((tmp_path / run / "finetune_hf.json").read_text()))
        torch.manual_seed(len(summaries))  # whatever this process drew before
    summary = summaries[0]
    assert summary["steps"] == 2 and summary["train_examples"] == 16 and 0 <= summary["dev_accuracy"] <= 1
    assert summaries[1]["train_loss"] == summary["train_loss"] and summaries[1]["dev_loss"] == summary["dev_loss"]
    assert load("AutoModelForSequenceClassification", tmp_path / "ft").num_labels == 2
    capsys.readouterr()
    for content, message in (("", "is empty"), ("sentence\tlabel\n", "has a header but no rows"),
                             ("sentence\tlabel\na good day\t1\nno label\n", "train.tsv:3 has 1 column(s)"),
                             ("sentence\tlabel\na good day\tpos\n", "train.tsv:2: the label 'pos' is not an integer")):
        (task / "train.tsv").write_text(content)
        assert finetune_hf.main(["--model", str(out), "--task", str(task), "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and str(task) in err, (content, err)
    (task / "train.tsv").write_text("sentence\tlabel\na good day\t1\na bad day\t-1\n")  # classes must be 0..K-1
    assert finetune_hf.main(["--model", str(out), "--task", str(task), "--out", str(tmp_path / "bad")]) == 2
    assert capsys.readouterr().err == f"error: {task}: labels must be 0, 1, ..., found [-1, 0, 1]\n"
    (task / "train.tsv").write_text("sentence\tlabel\na good day\t1\na bad day\t0\n")
    assert finetune_hf.main(["--model", str(tmp_path / "nonexist"), "--task", str(task), "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --model {tmp_path / 'nonexist'} is not a model folder")
