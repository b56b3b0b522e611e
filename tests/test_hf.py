"""An existing Hugging Face masked LM as the auxiliary model (`[aux] source = "hf:PATH"`, common/hf.py).

Offline: tiny randomly initialised masked LMs of four families (BERT, ELECTRA's generator, RoBERTa,
DeBERTa-v2) and tokenizers trained here with `tokenizers` on the test corpus, saved with
`save_pretrained` to temporary folders. Each model's logit table is 8 rows longer than its
tokenizer (padded, as some releases are), and the WordPiece ones carry [unusedN] entries."""
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from common.checkpoint import AUX_FILE, load_aux  # noqa: E402
from common.config import dump_toml  # noqa: E402
from common.corpus import SplitRows, load_corpus_meta, term_counts  # noqa: E402
from common.corrupt import Corruptor  # noqa: E402
from common.tokenizer import CLS_ID, MASK_ID, PAD_ID, SEP_ID, UNK_ID, open_tokenizer  # noqa: E402
from tests.conftest import ROOT, tiny_config, write_text_corpus  # noqa: E402

FAMILIES = ("bert", "electra", "roberta", "deberta-v2")
WORDPIECE_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", "[unused1]", "[unused2]"]
BPE_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def _texts(folder: Path) -> list[str]:
    return [p.read_text() for p in sorted(folder.glob("*.txt"))]


def make_tokenizer(family: str, texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    if family == "roberta":  # byte-level BPE with <s> </s> <pad> <mask>, cased
        t = Tokenizer(models.BPE(unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        t.decoder = decoders.ByteLevel()
        t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=BPE_SPECIALS,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        names = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                     cls_token="<s>", sep_token="</s>")
    else:  # WordPiece, lowercased (the ELECTRA releases' convention)
        t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        t.normalizer = normalizers.BertNormalizer(lowercase=True)
        t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        t.decoder = decoders.WordPiece()
        t.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=300, special_tokens=WORDPIECE_SPECIALS))
        t.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", t.token_to_id("[CLS]")), ("[SEP]", t.token_to_id("[SEP]"))])
        names = dict(unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, **names)
    tok.save_pretrained(str(out))
    return tok


def make_model(family: str, vocab: int, pad_id: int, out: Path, positions: int = 64):
    tf = transformers
    shape = dict(vocab_size=vocab + 8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=positions, pad_token_id=pad_id)
    if family == "bert":
        model = tf.BertForMaskedLM(tf.BertConfig(**shape))
    elif family == "electra":
        model = tf.ElectraForMaskedLM(tf.ElectraConfig(embedding_size=32, **shape))
    elif family == "roberta":
        model = tf.RobertaForMaskedLM(tf.RobertaConfig(**{**shape, "max_position_embeddings": positions + pad_id + 1}))
    else:
        model = tf.DebertaV2ForMaskedLM(tf.DebertaV2Config(relative_attention=True, position_biased_input=False,
                                                           **shape))
    torch.manual_seed(0)
    model.apply(model._init_weights)
    model.save_pretrained(str(out))
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """One masked LM directory per family (model + its tokenizer), and the raw corpus."""
    root = tmp_path_factory.mktemp("hf")
    raw = write_text_corpus(root / "raw", num_docs=6, seed=3)
    texts = _texts(raw)
    dirs = {}
    for family in FAMILIES:
        d = root / family
        tok = make_tokenizer(family, texts, d)
        make_model(family, len(tok), tok.pad_token_id, d)
        dirs[family] = d
    return raw, dirs


def _config(work: Path, raw: Path, source: Path, **train):
    config = tiny_config(work)
    return dataclasses.replace(config, corpus=dataclasses.replace(config.corpus, source=str(raw)),
                               aux=dataclasses.replace(config.aux, source=f"hf:{source}"),
                               train=dataclasses.replace(config.train, max_steps=4, **train))


def _stage(module: str, manifest: Path, *extra, env=None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", module, "--manifest", str(manifest), *extra], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, env=env)
    return result


@pytest.mark.slow
def test_corpus_generate_train_finetune_with_an_hf_aux_as_users_run_them(hf_dirs, tmp_path, env_with_repo):
    """corpus (its tokenizer) -> aux (recorded, not trained) -> generate (Ray, 2 actors, 2 epochs) -> train 4
    steps (the trainer sees ids only: the family is the shards') -> fine-tune, then 1 worker against 2, byte for
    byte; the stages as users run them, on BERT. Each family's own part (its tokenizer through the corpus
    build, its model's record, logits, shape and replacements) is `test_each_family_builds_a_corpus_...` below,
    in this process. (In one pytest process, generation on Ray after an in-process corpus build with the
    Hugging Face tokenizer hung: every stage here runs as its command.)"""
    raw, dirs = hf_dirs
    config = _config(tmp_path / "work", raw, dirs["bert"])
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(config))
    for module, extra in [("corpus", ["--workers", "1"]), ("auxiliary", []), ("generate", ["--workers", "2"]),
                          ("train", [])]:
        result = _stage(module, manifest, *extra, env=env_with_repo)
        assert result.returncode == 0, (module, result.stdout[-2000:], result.stderr[-3000:])
    corpus = load_corpus_meta(config.corpus_dir)
    tok = open_tokenizer(config.corpus_dir)
    assert corpus["vocab_size"] == tok.vocab_size == len(tok.tok) and tok.source == str(dirs["bert"])
    assert json.loads((config.run_dir / "summary.json").read_text())["steps"] == 4
    # the run fine-tunes with the corpus's own (Hugging Face) tokenizer, as `make finetune` runs it
    task, words = tmp_path / "task", " ".join(_texts(raw)).split()
    task.mkdir()
    for split, n in (("train", 16), ("dev", 8)):
        (task / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(
            f"{' '.join(words[8 * i:8 * i + 8])}\t{i % 2}\n" for i in range(n)))
    result = subprocess.run([sys.executable, "-m", "finetune", "--checkpoint", str(config.run_dir), "--task",
                             str(task), "--out", str(tmp_path / "ft"), "--no-progress", "--set", "seeds=[1]",
                             "--set", "max_steps=2", "--set", "grid.lr=[1e-4]"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env=env_with_repo)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "ft" / "results.json").read_text())
    assert results["backbone"]["tokenizer"] == str(config.corpus_dir / "hf_tokenizer")
    data = json.loads((config.epochs_dir / "manifest.json").read_text())
    assert data["vocab_size"] == tok.vocab_size and data["tokenizer_sha256"] == corpus["tokenizer_sha256"]
    assert len(data["epochs"]) == 2
    # the same shards from one worker as from two
    one = tmp_path / "one_worker"
    result = _stage("generate", manifest, "--workers", "1", "--out", str(one), env=env_with_repo)
    assert result.returncode == 0, result.stderr[-3000:]
    two = {p.relative_to(config.epochs_dir): p.read_bytes() for p in sorted(config.epochs_dir.rglob("*.parquet"))}
    assert len(two) > 2 and two == {p.relative_to(one): p.read_bytes() for p in sorted(one.rglob("*.parquet"))}


def _built(hf_dirs, family, tmp_path):
    """Corpus and aux record built in-process (one local worker: no Ray)."""
    from auxiliary.mlm import use_hf_aux
    from corpus.build import build_corpus
    raw, dirs = hf_dirs
    config = _config(tmp_path / "work", raw, dirs[family])
    build_corpus(config, config.corpus_dir, workers=1, log=lambda *a: None)
    use_hf_aux(config, config.corpus_dir, config.aux_dir, log=lambda *a: None)
    return config


def test_new_weights_in_a_sharded_model_make_the_aux_record_stale(hf_dirs, tmp_path):
    """A model saved in shards (model-0000k-of-N.safetensors and their index, as large hub models are): its
    hash covers the shards, so weights replaced under the same names are a new aux model (a new generation
    key), not the old record reused."""
    import shutil
    from auxiliary.mlm import use_hf_aux
    from common.aux_record import aux_is_current
    from corpus.build import build_corpus
    raw, dirs = hf_dirs
    source = shutil.copytree(dirs["bert"], tmp_path / "sharded")
    (source / "model.safetensors").unlink()
    tok = transformers.AutoTokenizer.from_pretrained(str(source))
    make_model("bert", len(tok), tok.pad_token_id, tmp_path / "scratch").save_pretrained(str(source),
                                                                                       max_shard_size="100KB")
    shards = sorted(p.name for p in source.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (source / "model.safetensors.index.json").is_file()
    config = _config(tmp_path / "work", raw, source)
    build_corpus(config, config.corpus_dir, workers=1, log=lambda *a: None)
    use_hf_aux(config, config.corpus_dir, config.aux_dir, log=lambda *a: None)
    assert aux_is_current(config, config.corpus_dir, config.aux_dir)
    torch.manual_seed(1)
    model = transformers.BertForMaskedLM.from_pretrained(str(source))
    with torch.no_grad():
        model.bert.encoder.layer[1].output.dense.weight.add_(0.5)  # the tensors of one shard change
    model.save_pretrained(str(source), max_shard_size="100KB")
    assert sorted(p.name for p in source.glob("model-*-of-*.safetensors")) == shards
    assert not aux_is_current(config, config.corpus_dir, config.aux_dir)
    # records made before: of a sharded model they covered config.json alone (not taken as current); of a
    # single-file model with both weight files, both files (taken as current: the model did not change)
    from common.hf import LEGACY_MODEL_FILES, files_sha256, model_unchanged
    assert not model_unchanged(source, files_sha256(source, LEGACY_MODEL_FILES))
    both = shutil.copytree(dirs["bert"], tmp_path / "both")
    torch.save(transformers.BertForMaskedLM.from_pretrained(str(both)).state_dict(), both / "pytorch_model.bin")
    assert model_unchanged(both, files_sha256(both, LEGACY_MODEL_FILES))
    assert model_unchanged(both, files_sha256(both, {"config.json", "model.safetensors"}))

def test_an_hf_corpus_is_rebuilt_when_the_sample_that_orders_its_ids_changes(hf_dirs, tmp_path):
    """The hf: tokenizer's ids are ordered by piece counts on the corpus sample: [tokenizer] max_sentences
    and max_sample_mb decide the bytes, so they stay in the corpus key (vocab_size does not apply)."""
    from corpus.build import corpus_is_current
    config = _built(hf_dirs, "bert", tmp_path)
    current = lambda **t: corpus_is_current(dataclasses.replace(  # noqa: E731
        config, tokenizer=dataclasses.replace(config.tokenizer, **t)), config.corpus_dir, config.corpus.source)
    assert current() and current(vocab_size=999)
    assert not current(max_sentences=3) and not current(max_sample_mb=0.001)

@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_builds_a_corpus_whose_replacements_use_allowed_ids_and_labels_follow_the_ids(
        hf_dirs, family, tmp_path):
    """The family's tokenizer through the corpus build, its model recorded as the aux, then what a generation
    actor does with it (the Corruptor of the manifest's [generate], the shape its memory estimate reads)."""
    from common.memory import AuxShape, aux_shape
    config = _built(hf_dirs, family, tmp_path)
    corpus = load_corpus_meta(config.corpus_dir)
    tok = open_tokenizer(config.corpus_dir)
    assert corpus["vocab_size"] == tok.vocab_size == len(tok.tok) and tok.source == str(hf_dirs[1][family])
    assert corpus.get("reserved_ids", {"head": 5, "tail": 0}) == dataclasses.asdict(tok.reserved)
    actor = Corruptor.from_config(config.aux_dir / AUX_FILE, config.seed, config.generate, config.corpus_dir)
    assert aux_shape(actor.model, actor.vocab_size) == AuxShape(32, 64, 2, tok.vocab_size)  # `make_model`'s
    hf_tok = tok.tok
    specials = {tok.tok.pad_token_id, tok.tok.unk_token_id, tok.tok.mask_token_id,
                tok.tok.cls_token_id or tok.tok.bos_token_id, tok.tok.sep_token_id or tok.tok.eos_token_id}
    assert [int(tok.hf_of[i]) for i in (PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID)] == [
        hf_tok.pad_token_id, hf_tok.unk_token_id, hf_tok.cls_token_id or hf_tok.bos_token_id,
        hf_tok.sep_token_id or hf_tok.eos_token_id, hf_tok.mask_token_id]
    stop = tok.reserved.stop(tok.vocab_size)
    never = set(tok.hf_of[:tok.reserved.head].tolist()) | set(tok.hf_of[stop:].tolist())
    assert specials <= never
    if family == "bert":
        assert {hf_tok.convert_tokens_to_ids(f"[unused{i}]") for i in range(3)} <= never
    rows = SplitRows(config.corpus_dir, "train")
    sample = [rows[i] for i in range(min(64, len(rows)))]
    corruptor = Corruptor(config.aux_dir / AUX_FILE, seed=1, mask_prob=0.3, batch_tokens=512)
    # a high temperature spreads the mass over the whole vocabulary, reserved columns included if allowed
    out = corruptor(sample, np.arange(len(sample)), 0, np.full(len(sample), 50.0))
    for original, corrupted, labels in zip(sample, out["input_ids"], out["labels"]):
        changed = corrupted != original
        assert np.array_equal(labels.astype(bool), changed)  # a sample equal to the original is labelled original
        assert (corrupted[changed] >= tok.reserved.head).all() and (corrupted[changed] < stop).all()
        assert corrupted[0] == CLS_ID and corrupted[-1] == SEP_ID  # masking never touches the specials
    assert out["replaced"] > 0
    model, _ = load_aux(config.aux_dir / AUX_FILE)
    ids = torch.from_numpy(sample[0][None].astype(np.int64))
    flags = torch.zeros_like(ids, dtype=torch.bool)
    flags[0, 1:4] = True
    logits = model(ids, torch.ones_like(flags), flags)
    assert logits.shape == (3, tok.vocab_size)  # masked positions only, our columns only (no padded rows)
    # `make plots` on this corpus: the section 5.1 figure's distributions give the reserved ids no mass either
    from generate.plots import example_distributions, main as plots
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(config))
    assert plots(["--manifest", str(manifest), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "replaced_token_distributions.png").read_bytes()[:4] == b"\x89PNG"
    example = example_distributions(model, tok, term_counts(config.corpus_dir))
    for name, probs in example["distributions"].items():
        assert abs(float(probs.sum()) - 1) < 1e-5 and probs[:tok.reserved.head].sum() == 0, name
        assert probs[stop:].sum() == 0, (name, float(probs[stop:].sum()))
    assert sorted(example["rank"].tolist()) == list(range(tok.reserved.head, stop))


def test_frequent_pieces_get_the_smallest_ids_and_the_reserved_block_the_largest(hf_dirs, tmp_path):
    """Compact shards: after the five specials an hf: tokenizer's pieces are numbered by their frequency in the
    tokenizer sample (here the whole training split), so frequent tokens get the small ids BYTE_STREAM_SPLIT
    stores best; its other special tokens and [unusedN] entries, never sampled, come last."""
    config = _built(hf_dirs, "bert", tmp_path)
    tok = open_tokenizer(config.corpus_dir)
    stop = tok.reserved.stop(tok.vocab_size)
    assert (tok.reserved.head, tok.reserved.tail) == (5, 3)
    assert [tok.piece(i) for i in range(stop, tok.vocab_size)] == ["[unused0]", "[unused1]", "[unused2]"]
    rows = SplitRows(config.corpus_dir, "train")
    counts = np.bincount(np.concatenate([rows[i] for i in range(len(rows))]), minlength=tok.vocab_size)
    assert counts[5] == counts[5:].max() and (np.diff(counts[5:stop]) <= 0).mean() > 0.95, counts[5:40]


@pytest.mark.parametrize("family", ("bert", "roberta"))
def test_special_tokens_written_in_the_text_are_spelled_out_not_read_as_specials(hf_dirs, tmp_path, family):
    """Corpus text holding "[SEP]", "[PAD]", "<s>", "</s>", "[MASK]" as words: the corpus stage's encoding
    (`encode_native`, and the counts that order the ids) spells them out, as text, so rows hold the specials
    only where the corpus stage puts them (the Hugging Face tokenizer's default reads them as the specials)."""
    from common.hf import HFTokenizer, build_tokenizer
    from common.tokenizer import META_FILE
    raw, dirs = hf_dirs
    words = " ".join(_texts(raw)).split()[:12]
    literal = ["[SEP]", "[PAD]", "[CLS]", "[MASK]", "<s>", "</s>", "<pad>", "<mask>"]
    text = " ".join(w for pair in zip(words, literal) for w in pair)
    build_tokenizer(dirs[family], [text] * 3, tmp_path, META_FILE)
    meta = json.loads((tmp_path / META_FILE).read_text())
    tok = HFTokenizer(tmp_path, meta)
    ids = tok.encode(text)
    # [UNK] may stand for a character the tokenizer never saw ("[" in a WordPiece trained on text without one)
    assert not {PAD_ID, CLS_ID, SEP_ID, MASK_ID} & set(ids), [tok.piece(i) for i in ids]
    assert not set(ids) & set(range(tok.reserved.stop(tok.vocab_size), tok.vocab_size))
    assert len(ids) > len(words) + 2 * len(literal)  # each written special: several pieces


def test_bad_hf_directories_stop_before_any_work(hf_dirs, tmp_path, capsys):
    """`python -m corpus` / `python -m auxiliary` (their main(), in this process) on a directory without a
    masked-LM head, without a tokenizer, and with fewer positions than the rows: exit 2, one line."""
    from auxiliary.__main__ import main as aux_main
    from corpus.__main__ import main as corpus_main
    raw, dirs = hf_dirs
    plain = tmp_path / "plain"  # a BertModel: no masked-LM head
    cfg = transformers.BertConfig(vocab_size=400, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64)
    transformers.BertModel(cfg).save_pretrained(str(plain))
    transformers.AutoTokenizer.from_pretrained(str(dirs["bert"])).save_pretrained(str(plain))
    no_tokenizer = tmp_path / "no_tokenizer"
    transformers.BertForMaskedLM(cfg).save_pretrained(str(no_tokenizer))
    short = tmp_path / "short"  # 16 positions, rows of 32 tokens
    make_model("bert", 300, 0, short, positions=16)
    transformers.AutoTokenizer.from_pretrained(str(dirs["bert"])).save_pretrained(str(short))
    small = tmp_path / "small"  # the tokenizer's ids past the model's vocabulary
    tok = transformers.AutoTokenizer.from_pretrained(str(dirs["bert"]))
    make_model("bert", len(tok) - 30, 0, small)
    tok.save_pretrained(str(small))
    damaged = tmp_path / "damaged"  # weights cut short
    shutil.copytree(dirs["bert"], damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    cases = {plain: "no masked-LM head", no_tokenizer: "holds no tokenizer", short: "beyond the 16 positions",
             small: f"its tokenizer has ids up to {len(tok) - 1}, but the model's vocabulary has {len(tok) - 22}",
             damaged: "its weights do not load"}
    for folder, message in cases.items():
        config = _config(tmp_path / f"work-{folder.name}", raw, folder)
        manifest = tmp_path / f"{folder.name}.toml"
        manifest.write_text(dump_toml(config))
        code = corpus_main(["--manifest", str(manifest), "--workers", "1"])
        err = capsys.readouterr().err
        assert code == 2, (folder.name, err[-2000:])
        assert message in err and str(folder) in err and "Traceback" not in err, err[-2000:]
        assert not config.corpus_dir.exists()  # nothing was built
    # the aux stage checks the model too (a corpus built for a good model, then the model replaced)
    good = tmp_path / "swapped"
    shutil.copytree(dirs["bert"], good)
    config = _config(tmp_path / "work-swapped", raw, good)
    manifest = tmp_path / "swapped.toml"
    manifest.write_text(dump_toml(config))
    assert corpus_main(["--manifest", str(manifest), "--workers", "1"]) == 0
    shutil.copy(plain / "model.safetensors", good / "model.safetensors")
    shutil.copy(plain / "config.json", good / "config.json")
    capsys.readouterr()
    assert aux_main(["--manifest", str(manifest)]) == 2
    err = capsys.readouterr().err
    assert "no masked-LM head" in err and "Traceback" not in err, err[-2000:]
    # a mistyped hf: path where a corpus was built: one line, not the corpus key's traceback
    mistyped = dataclasses.replace(config, aux=dataclasses.replace(config.aux, source=f"hf:{tmp_path / 'bret'}"))
    manifest.write_text(dump_toml(mistyped))
    assert corpus_main(["--manifest", str(manifest), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'bret'} is not a folder" in err and "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize("config_says", ("legacy = false", "nothing"))
def test_a_deberta_in_the_original_head_layout_serves_with_its_own_logits(hf_dirs, tmp_path, config_says):
    """DeBERTa-v2 / v3 releases keep their head as lm_predictions.* (transformers: `legacy = false`; a config
    without the key would drop the head): loaded with it, its logits at the masked positions are the model's own."""
    from common.hf import HFMaskedLM
    raw, dirs = hf_dirs
    folder = tmp_path / "deberta"
    tok = make_tokenizer("deberta-v2", _texts(raw), folder)
    cfg = transformers.DebertaV2Config(vocab_size=len(tok) + 8, hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                       pad_token_id=tok.pad_token_id, relative_attention=True,
                                       position_biased_input=False, legacy=False)
    torch.manual_seed(0)
    model = transformers.DebertaV2ForMaskedLM(cfg).eval()
    model.save_pretrained(str(folder))
    if config_says == "nothing":
        saved = json.loads((folder / "config.json").read_text())
        saved.pop("legacy")
        (folder / "config.json").write_text(json.dumps(saved))
    ours = HFMaskedLM(folder, np.arange(len(tok))).eval()
    ids = torch.as_tensor([tok("the king speaks to the queen")["input_ids"]])
    flags = torch.zeros_like(ids, dtype=torch.bool)
    flags[0, 2:4] = True
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[flags][:, :len(tok)]
        got = ours(ids, torch.ones_like(ids), flags)  # the head on the masked rows only: measured 1.2e-7 apart
        assert got.shape == own.shape and (got - own).abs().max() < 1e-5, (got - own).abs().max()


def test_a_model_saved_in_half_precision_serves_in_float32_with_the_same_weights(hf_dirs, tmp_path):
    """transformers loads weights in the dtype their config records: a BERT saved with .half() ran the
    generator's aux forward in fp16 on a CPU (5x the fp32 time, other draws than the design's fp32)."""
    from common.hf import load_masked_lm
    raw, dirs = hf_dirs
    folder = tmp_path / "half"
    tok = make_tokenizer("bert", _texts(raw), folder)
    half = make_model("bert", len(tok), tok.pad_token_id, tmp_path / "full").half()
    half.save_pretrained(str(folder))
    loaded = load_masked_lm(folder)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert all(torch.equal(p.float(), q) for p, q in zip(half.parameters(), loaded.parameters()))


def _more_layers_in_the_config(folder: Path, dirs) -> str:
    shutil.copytree(dirs["bert"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    return "its weights lack 16 tensor(s) of the model its config.json describes (bert.encoder.layer.2."


def _another_vocab_size_in_the_config(folder: Path, dirs) -> str:
    shutil.copytree(dirs["bert"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 5}))
    rows = config["vocab_size"]
    return (f"{folder / 'config.json'} does not describe the weights in {folder}: bert.embeddings.word_embeddings"
            f".weight is [{rows}, 32] there, the config makes it [{rows + 5}, 32]")


def _distilbert(folder: Path, dirs) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(str(dirs["bert"]))
    tok.save_pretrained(str(folder))
    cfg = transformers.DistilBertConfig(vocab_size=len(tok) + 8, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                        max_position_embeddings=64, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.DistilBertForMaskedLM(cfg).save_pretrained(str(folder))
    return "model_type 'distilbert' (DistilBertForMaskedLM) is not supported as an auxiliary model"


@pytest.mark.parametrize("make", (_more_layers_in_the_config, _another_vocab_size_in_the_config, _distilbert))
def test_a_model_that_would_load_wrong_or_crash_is_refused_in_one_line(hf_dirs, tmp_path, capsys, make):
    """A config.json with more layers than the weights (transformers filled the missing layers with random
    values, and only a missing head was refused); one whose vocab_size is not the weights' (transformers' own
    RuntimeError points at a report its silenced logging never shows); a family whose head is not its
    non-base children run in order (DistilBERT: its loss module among them, a TypeError): `python -m corpus`
    exits 2 with one line naming the folder and what is wrong, before any work."""
    from corpus.__main__ import main as corpus_main
    from common.hf import SUPPORTED_FAMILIES
    raw, dirs = hf_dirs
    folder = tmp_path / "model"
    message = make(folder, dirs)
    config = _config(tmp_path / "work", raw, folder)
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(config))
    assert corpus_main(["--manifest", str(manifest), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("error: "), err[-2000:]
    assert message in err.splitlines()[-1] and str(folder) in err, err[-2000:]
    if make is _distilbert:
        assert ", ".join(SUPPORTED_FAMILIES) in err
    assert not config.corpus_dir.exists()
