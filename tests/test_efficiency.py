"""bench.efficiency at the paper's vocabulary proportion (`--vocab paper`): every mode's models get
V = round(128000 * hidden / 768) rows, one update runs and moves the weights; the analytic ratio
falls with V. Shards are written in-process (ShardWriter, no Ray), so the test is fast."""
import json

import pytest
import torch

from bench.efficiency import MODES, Mode, analytic_ratios, bench_aux, paper_vocab, resolve_vocab
from common.checkpoint import AUX_FILE
from common.config import config_from_dict, config_to_dict
from common.corpus import SplitRows, load_corpus_meta
from common.model import Encoder
from common.shards import SHARD_SCHEMA
from common.plan import plan_tasks
from common.corrupt import Corruptor
from generate.worker import ShardWriter
from common.shards import MANIFEST_FILE


def write_one_shard(config, out_dir):
    """The first training shard of the plan and a manifest.json that lists only it."""
    meta = load_corpus_meta(config.corpus_dir)
    task = next(t for t in plan_tasks(meta["train"]["rows"], meta["valid"]["rows"], config.generate, config.seed)
                if t.split == "train")
    g = config.generate
    corruptor = Corruptor(config.aux_dir / AUX_FILE, config.seed, g.mask_prob, g.batch_tokens)
    record = ShardWriter({"train": SplitRows(config.corpus_dir, "train")}, corruptor, out_dir)(task)
    (out_dir / MANIFEST_FILE).write_text(json.dumps({
        "vocab_size": meta["vocab_size"], "max_seq_len": meta["max_seq_len"],
        "schema": [{"name": f.name, "type": str(f.type)} for f in SHARD_SCHEMA],
        "epochs": [{"shards": [record]}], "valid": {"shards": []}}))
    return out_dir


def token_embedding_rows(model) -> set[int]:
    """Rows of every token embedding in `model` (the relative-position bias tables left out)."""
    return {m.embed.num_embeddings for m in model.modules() if isinstance(m, Encoder)}


def test_every_mode_runs_with_the_papers_vocabulary(built, tmp_path, monkeypatch):
    """... and every update each mode times is a call of the trainer's own update function (counted
    through a wrapper that calls it)."""
    import train.trainer as trainer
    calls, real = [], trainer.update
    monkeypatch.setattr(trainer, "update", lambda *a, **k: (calls.append(a[9].objective), real(*a, **k))[1])
    config = built
    vocab = resolve_vocab("paper", config)
    assert vocab == paper_vocab(config.model.hidden_size) == round(128000 * 32 / 768) > config.tokenizer.vocab_size
    data = write_one_shard(config, tmp_path)
    torch.set_num_threads(1)
    with bench_aux(config, vocab) as aux_path:
        assert aux_path != config.aux_dir / AUX_FILE and aux_path.name == AUX_FILE
        for name in MODES:
            mode = Mode(name, config, data, torch.device("cpu"), vocab, aux_path)
            assert token_embedding_rows(mode.model) == {vocab}
            if name == "electra":  # the generator's MLM output is tied to the shared V-row embedding
                assert mode.model.generator.head.bias.shape == (vocab,)
            if name == "fast-online":  # the frozen aux model has V rows too, and its samples flow through
                aux = mode.stream.corruptor.model
                assert token_embedding_rows(aux) == {vocab} and aux.head.bias.shape == (vocab,)
                ids = mode.stream.rows(0, config.train.batch_size)["input_ids"]
                assert max(int(r.max()) for r in ids) >= config.tokenizer.vocab_size  # beyond the tokenizer's ids
            before = [p.detach().clone() for p in mode.model.parameters()]
            mode.step()
            mode.step()  # the first update runs at warm-up lr 1/2, both move the weights
            assert any(not torch.equal(a, p) for a, p in zip(before, mode.model.parameters())), name
            assert all(torch.isfinite(p).all() for p in mode.model.parameters()), name
    assert not aux_path.exists()  # the random aux lived in a temporary folder
    assert calls == [name for name in MODES for _ in range(2)]


def test_bigger_vocabulary_lowers_the_offline_to_electra_ratio(built):
    values = config_to_dict(built)
    values["model"].update(hidden_size=256, num_layers=6, num_heads=4, ffn_size=1024)
    values["corpus"]["max_seq_len"] = 128
    config = config_from_dict(values)
    small, paper = analytic_ratios(config, 8000), analytic_ratios(config, paper_vocab(256))
    assert paper_vocab(256) == 42667
    for convention in ("paper_convention", "as_executed"):
        assert paper[convention]["offline_vs_electra"] < small[convention]["offline_vs_electra"]
    assert analytic_ratios(config) == analytic_ratios(config, config.tokenizer.vocab_size)


def test_a_vocabulary_smaller_than_the_datas_is_refused(built):
    with pytest.raises(ValueError, match="smaller than the data's"):
        resolve_vocab(100, built)
    assert resolve_vocab(0, built) == built.tokenizer.vocab_size
