"""Files a stage wrote that come back damaged (cut short, edited, another program's), and output folders that
are not the stage's own: a one-line error that names the file and how to make it again, never a traceback;
what the file's stage can rebuild, it rebuilds; `--force` never deletes a folder it did not write."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from common.checkpoint import AUX_FILE, AUX_META, IncompatibleInputs, read_aux_meta, safe_load
from common.corpus import CORPUS_META, load_corpus_meta
from common.io import DamagedFile, read_json
from common.shards import MANIFEST_FILE, PLAN_FILE, data_fingerprint
from tests.conftest import ROOT

DAMAGE = {"cut short": '{"vocab_size": 320, "max_seq', "a list": "[1, 2]", "no keys": "{}"}


@pytest.mark.parametrize("damage", DAMAGE)
def test_read_json_names_the_file_what_is_wrong_and_the_remedy(tmp_path, damage):
    path = tmp_path / "manifest.json"
    path.write_text(DAMAGE[damage])
    with pytest.raises(DamagedFile) as error:
        read_json(path, ("vocab_size",), "run the stage again")
    message = str(error.value)
    assert str(path) in message and message.endswith("; run the stage again"), message
    assert {"cut short": "not JSON", "a list": "a JSON list", "no keys": "no vocab_size"}[damage] in message
    path.write_text('{"vocab_size": 320}')
    assert read_json(path, ("vocab_size",)) == {"vocab_size": 320}


@pytest.mark.slow  # the session's generated folder (Ray)
@pytest.mark.parametrize("damage", DAMAGE)
def test_the_trainer_stops_on_a_damaged_data_manifest_with_one_line(generated, tmp_path, capsys, damage):
    from train.__main__ import main as train_main
    manifest, data, _ = generated
    copy = shutil.copytree(data, tmp_path / "epochs")
    (copy / MANIFEST_FILE).write_text(DAMAGE[damage])
    assert train_main(["--manifest", str(manifest), "--data", str(copy), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert f"{copy / MANIFEST_FILE} is damaged" in err and "make generate-epochs" in err, err


@pytest.mark.slow  # the session's generated folder (Ray)
def test_the_generator_writes_a_damaged_manifest_again_from_the_shards_records(generated, tmp_path):
    """A complete folder whose manifest.json was cut short: the generator rewrites it (the same shards and
    fingerprint, nothing regenerated: no Ray is started for an empty to-do list)."""
    from common.config import load_manifest
    from generate.generator import generate
    manifest, data, _ = generated
    config = load_manifest(manifest)
    copy = shutil.copytree(data, tmp_path / "epochs")
    before = json.loads((copy / MANIFEST_FILE).read_text())
    shards = {p: p.stat().st_mtime_ns for p in copy.rglob("*.parquet")}
    (copy / MANIFEST_FILE).write_text('{"epochs": [')
    logged = []
    after = generate(config, copy, config.corpus_dir, config.aux_dir / AUX_FILE, 1, None, False, log=logged.append)
    assert any(f"{copy / MANIFEST_FILE} is damaged" in line and "writing it again" in line for line in logged), logged
    assert json.loads((copy / MANIFEST_FILE).read_text()) == after
    assert data_fingerprint(after) == data_fingerprint(before) and after["epochs"] == before["epochs"]
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("*.parquet")} == shards


@pytest.mark.slow  # the session's generated folder (Ray)
def test_a_damaged_plan_stops_the_generator_unless_forced(generated, tmp_path):
    from common.config import load_manifest
    from generate.generator import OutputConflict, check_inputs
    manifest, data, _ = generated
    config = load_manifest(manifest)
    copy = shutil.copytree(data, tmp_path / "epochs")
    (copy / PLAN_FILE).write_text("not json")
    with pytest.raises(OutputConflict, match=f"{copy / PLAN_FILE} is damaged.*--force"):
        check_inputs(config, config.corpus_dir, config.aux_dir / AUX_FILE, copy, force=False)
    assert (copy / MANIFEST_FILE).is_file()
    check_inputs(config, config.corpus_dir, config.aux_dir / AUX_FILE, copy, force=True)  # a folder of shards: replaced
    assert not copy.exists()


def test_force_never_deletes_a_folder_that_holds_no_shards(built, tmp_path):
    """A mistyped --out (here a copy of the corpus folder) is refused with or without --force; a folder of
    shards whose plan.json is gone (its progress log left) is still one --force replaces."""
    from generate.generator import OutputConflict, check_inputs
    corpus = shutil.copytree(built.corpus_dir, tmp_path / "corpus")
    before = sorted(p.relative_to(corpus) for p in corpus.rglob("*"))
    for force in (False, True):
        with pytest.raises(OutputConflict, match=f"{corpus} is not empty and holds no plan.json: not a folder of shards"):
            check_inputs(built, built.corpus_dir, built.aux_dir / AUX_FILE, corpus, force=force)
    assert sorted(p.relative_to(corpus) for p in corpus.rglob("*")) == before
    shards = tmp_path / "epochs"
    (shards / "epoch-000").mkdir(parents=True)
    (shards / "progress.jsonl").write_text("")
    with pytest.raises(OutputConflict, match="holds shards of an unknown generation .*--force to replace them"):
        check_inputs(built, built.corpus_dir, built.aux_dir / AUX_FILE, shards, force=False)
    check_inputs(built, built.corpus_dir, built.aux_dir / AUX_FILE, shards, force=True)
    assert not shards.exists()
    # what a --force replacement killed halfway leaves (its plan, progress and manifest deleted, shards not yet):
    # still a folder of shards; and a plan.json whose key is not a string is another generation's
    for files in (["epoch-001/shard-00000.parquet", "valid/shard-00000.parquet", "verified.json",
                   "resolved_manifest.toml"], ["epoch-000/shard-00003.parquet", PLAN_FILE]):
        for name in files:
            (shards / name).parent.mkdir(parents=True, exist_ok=True)
            (shards / name).write_text('{"generation_key": null}' if name == PLAN_FILE else "x")
        with pytest.raises(OutputConflict, match="--force to replace them"):
            check_inputs(built, built.corpus_dir, built.aux_dir / AUX_FILE, shards, force=False)
        check_inputs(built, built.corpus_dir, built.aux_dir / AUX_FILE, shards, force=True)
        assert not shards.exists()
    # a user's folder that happens to hold a plan.json or a manifest.json of its own is no folder of shards
    for name, content in ((PLAN_FILE, '{"milestones": []}'), (PLAN_FILE, "not json"), (MANIFEST_FILE, '{"name": "app"}')):
        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "thesis.tex").write_text("text")
        (mine / "epoch-000").mkdir()
        (mine / "epoch-000" / "notes.txt").write_text("text")
        (mine / name).write_text(content)
        with pytest.raises(OutputConflict, match=f"{mine} holds epoch-000/notes.txt, thesis.tex, which no generation "
                                                 f"writes: not replaced, even with --force"):
            check_inputs(built, built.corpus_dir, built.aux_dir / AUX_FILE, mine, force=True)
        assert (mine / "thesis.tex").is_file() and (mine / name).is_file()
        shutil.rmtree(mine)
    (tmp_path / "afile").write_text("text")
    with pytest.raises(OutputConflict, match=f"--out {tmp_path / 'afile'} is a file, not a folder"):
        check_inputs(built, built.corpus_dir, built.aux_dir / AUX_FILE, tmp_path / "afile", force=True)


def test_a_damaged_corpus_json_is_named_and_the_corpus_stage_builds_it_again(built, tmp_path):
    from corpus.build import corpus_is_current
    corpus = shutil.copytree(built.corpus_dir, tmp_path / "corpus")
    assert corpus_is_current(built, corpus, built.corpus.source)
    (corpus / CORPUS_META).write_text("[]")
    with pytest.raises(DamagedFile, match=f"{corpus / CORPUS_META} is damaged .*`make corpus`"):
        load_corpus_meta(corpus)
    assert not corpus_is_current(built, corpus, built.corpus.source)  # so `make corpus` rebuilds it


def test_a_damaged_aux_json_is_named_and_the_aux_stage_publishes_it_again(built, tmp_path):
    from common.aux_record import aux_is_current
    aux = shutil.copytree(built.aux_dir, tmp_path / "aux")
    assert aux_is_current(built, built.corpus_dir, aux)
    (aux / AUX_META).write_text('{"sha256": "ab"}')
    with pytest.raises(DamagedFile, match=f"{aux / AUX_META} is damaged .*no tokenizer_sha256.*`make aux`"):
        read_aux_meta(aux / AUX_FILE)
    assert not aux_is_current(built, built.corpus_dir, aux)
    with pytest.raises(FileNotFoundError, match=f"auxiliary model {aux} is a folder: pass the model file in it, "
                                                f"{aux / AUX_FILE}"):
        read_aux_meta(aux)  # --aux DIR instead of DIR/aux.pt


def test_an_aux_pt_that_is_not_the_one_its_aux_json_names_says_make_aux_and_make_aux_publishes_again(built, tmp_path):
    """A kill between publishing aux.pt and aux.json (or aux.pt replaced): the generator's load names both
    hashes and the remedy, and the aux stage does not take the pair as current."""
    from common.aux_record import aux_is_current
    from common.checkpoint import load_aux
    aux = shutil.copytree(built.aux_dir, tmp_path / "aux")
    with open(aux / AUX_FILE, "ab") as f:
        f.write(b"\0")
    with pytest.raises(IncompatibleInputs, match=r"aux\.json says .*`make aux` publishes both again"):
        load_aux(aux / AUX_FILE)
    assert not aux_is_current(built, built.corpus_dir, aux)


def test_a_sweep_with_fewer_than_one_process_per_run_launches_nothing(tmp_path, capsys):
    from experiments.sweep import main as sweep_main
    with pytest.raises(SystemExit) as stop:
        sweep_main(["--nproc", "0", "--out", str(tmp_path / "sweep")])
    assert stop.value.code == 2 and "--nproc must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("content", [b"", b"hello", bytes(range(256)) * 8, b"PK\x03\x04" + b"\0" * 64])
def test_a_file_that_is_no_checkpoint_is_refused_by_name(tmp_path, content):
    path = tmp_path / "step-00000004.pt"
    path.write_bytes(content)
    with pytest.raises(DamagedFile, match=f"{path} is not a checkpoint this project wrote"):
        safe_load(path)


def test_resume_skips_a_newest_checkpoint_cut_short_for_the_one_before(tmp_path, capsys):
    """A kill mid-copy (or a full disk) leaves the newest checkpoint cut short: resuming takes the one before,
    as it always did (the message for a damaged file must not turn into the refusal kept for pickled code)."""
    import torch
    from common.checkpoint import latest_checkpoint, save_checkpoint
    for step in (1, 2):
        save_checkpoint({"step": step, "model": {"w": torch.full((64,), float(step))}}, tmp_path, keep=3)
    newest = tmp_path / "step-00000002.pt"
    newest.write_bytes(newest.read_bytes()[:newest.stat().st_size // 2])
    path, state = latest_checkpoint(tmp_path)
    assert path.name == "step-00000001.pt" and state["step"] == 1
    assert f"checkpoints: ignoring unreadable checkpoint {newest}" in capsys.readouterr().out


def test_pruning_keeps_the_checkpoints_a_run_resumed_from_a_damaged_newest_one_writes(tmp_path):
    """keep = 1 and a damaged step 10 beside checkpoints written from scratch (the trainer no longer starts over
    beside it, `train.state.restore`; a folder may still hold one): the checkpoints of steps 2 and 4 are the only
    readable ones, so they are what pruning keeps (by name, the damaged step 10 was kept and each new checkpoint
    deleted as it was written)."""
    import torch
    from common.checkpoint import latest_checkpoint, save_checkpoint
    damaged = tmp_path / "step-00000010.pt"
    damaged.write_bytes(b"PK\x03\x04 cut short")
    assert latest_checkpoint(tmp_path) is None
    for step in (2, 4):
        save_checkpoint({"step": step, "model": {"w": torch.full((8,), float(step))}}, tmp_path, keep=1)
        path, state = latest_checkpoint(tmp_path)
        assert state["step"] == step, path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004.pt", "step-00000010.pt"]
    save_checkpoint({"step": 10, "model": {"w": torch.zeros(8)}}, tmp_path, keep=1)  # over the damaged one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010.pt"]


def test_finetune_on_a_file_that_is_no_checkpoint_ends_with_one_line(tmp_path, capsys):
    from finetune.__main__ import main as finetune_main
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"hello")
    assert finetune_main(["--checkpoint", str(junk), "--task", str(tmp_path / "task")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and f"{junk} is not a checkpoint" in err, err


@pytest.mark.parametrize("key, value, message", [
    ("corpus.max_seq_len", 64, "has sequence length 32 but the manifest config has corpus.max_seq_len = 64"),
    ("tokenizer.vocab_size", 400, "has vocabulary 320 but the manifest config has tokenizer.vocab_size = 400"),
])
def test_the_generator_refuses_a_corpus_the_trainer_would_refuse_before_any_work(built, tmp_path, key, value,
                                                                                  message):
    """Shards made from a corpus of another length or vocabulary than the manifest's: the trainer of that
    manifest refuses them, so the generator refuses first, before a shard is paid for."""
    import dataclasses
    from generate.generator import check_inputs
    section, name = key.split(".")
    config = dataclasses.replace(built, **{section: dataclasses.replace(getattr(built, section), **{name: value})})
    with pytest.raises(IncompatibleInputs, match=f"corpus {built.corpus_dir} {message}"):
        check_inputs(config, built.corpus_dir, built.aux_dir / AUX_FILE, tmp_path / "epochs", force=False)


@pytest.mark.slow  # the session's generated folder (Ray)
def test_the_trainer_says_when_the_shards_were_made_with_other_generate_settings(generated):
    """Shards are reused across runs, so other [generate] settings than the manifest's are not an error; the
    trainer says which differ (its resolved_manifest.toml records the manifest's), and nothing for a match."""
    import dataclasses
    from common.config import load_manifest
    from train.data import open_data
    manifest, data, _ = generated
    config = load_manifest(manifest)
    said = []
    open_data(data, config, log=said.append)
    assert said == []
    sweep = dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=4, max_steps=3),
                                generate=dataclasses.replace(config.generate, tasks_in_flight=2))
    open_data(data, sweep, log=said.append)  # [train] and scheduling: not what made the shards
    assert said == []
    other = dataclasses.replace(config, generate=dataclasses.replace(config.generate, rows_per_epoch=64, t0=3.0))
    open_data(data, other, log=said.append)
    assert len(said) == 1 and f"the shards in {data} were made with other settings" in said[0], said
    assert "generate.rows_per_epoch 0, here 64; generate.t0 2.0, here 3.0" in said[0], said
    # epochs from the update budget, with none set (max_steps = 0): a note too, not an error about the budget
    budget = dataclasses.replace(config, generate=dataclasses.replace(config.generate, epochs=0))
    open_data(data, budget, log=said.append)
    assert "generate.epochs 2, here 0" in said[-1], said


def test_a_record_appended_after_a_torn_line_is_a_line_of_its_own(tmp_path):
    """A kill or a full disk mid-append leaves a line without its end: the next record (a rerun's) is not glued
    to it, so the generator's log and the trainer that follows it both read it."""
    from common.io import append_record, read_records
    from train.data import Follower
    log = tmp_path / "progress.jsonl"
    append_record(log, {"path": "shard-00000.parquet", "rows": 4})
    with open(log, "ab") as f:
        f.write(b'{"path": "shard-00001.parq')  # torn
    append_record(log, {"path": "shard-00002.parquet", "rows": 4})
    assert sorted(read_records(log, "path")) == ["shard-00000.parquet", "shard-00002.parquet"]
    assert Follower(tmp_path).record("shard-00002.parquet")["rows"] == 4


def test_a_resumed_run_drops_a_torn_metrics_line_and_the_plots_read_around_it(tmp_path):
    from common.config import RunConfig
    from train.plots import read_metrics
    from train.trainer import open_metrics
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"step": 4, "lo' + "\0" * 16)  # a full disk, then a crash
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    open_metrics(tmp_path, RunConfig(), step=2)
    assert path.read_text() == "\n".join(lines[:2]) + "\n"


def test_upload_temporaries_of_dead_writers_are_removed_and_a_live_writers_kept(tmp_path):
    import os
    import subprocess
    import sys
    from common.io import remove_dead_uploads
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid no longer runs
    import socket
    host = socket.gethostname()
    dead = tmp_path / f"shard-00003.parquet.tmp-{host}-{gone.pid}-140001"
    live = tmp_path / f"shard-00004.parquet.tmp-{host}-{os.getpid()}-140002"
    elsewhere = tmp_path / f"shard-00005.parquet.tmp-another-host-{gone.pid}-140003"  # a shared home folder
    for path in (dead, live, elsewhere):
        path.write_bytes(b"x" * 1024)
    remove_dead_uploads(tmp_path)
    assert not dead.exists() and live.exists() and elsewhere.exists()


def _damaged_corpus(built, tmp_path, kind: str):
    """A copy of the corpus with one value of train part 0's flat `kind` file (tokens, offsets) overwritten in
    place, the file's size kept (the size check passes: the damage is in the values)."""
    import numpy as np
    corpus = shutil.copytree(built.corpus_dir, tmp_path / "corpus")
    path = corpus / load_corpus_meta(corpus)["train"]["parts"][0]["flat"][kind]["path"]
    values = np.load(path, mmap_mode="r+")
    if kind == "offsets":
        values[3] = 10**12  # row 2 ends, row 3 starts, past any file
    else:
        values[values.size // 2] = 99_999  # past a 320-entry vocabulary
    values.flush()
    return corpus, path


@pytest.mark.parametrize("kind,message", [("offsets", "is damaged: row 2 of it spans tokens"),
                                          ("tokens", "is damaged: row .* holds token id 99999, outside the vocabulary")])
def test_a_corpus_row_of_damaged_values_is_an_error_naming_its_file(built, tmp_path, kind, message):
    """Offsets past the file (was: numpy allocating terabytes) and ids past the vocabulary (was: an index
    error in the embedding; on a GPU a device-side assert) name the part's file."""
    from common.corpus import SplitRows
    from common.sources import CorpusError
    corpus, path = _damaged_corpus(built, tmp_path, kind)
    rows = SplitRows(corpus, "train")
    with pytest.raises(CorpusError, match=f"^{path} {message}.*rebuild the corpus"):
        for i in range(len(rows)):
            rows[i]


@pytest.mark.slow  # Ray
def test_damaged_corpus_rows_read_in_a_generation_actor_stop_the_run_with_one_line(built, tmp_path, env_with_repo):
    import subprocess
    import sys
    from common.config import dump_toml
    from tests.conftest import ROOT
    corpus, path = _damaged_corpus(built, tmp_path, "tokens")
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(built))
    result = subprocess.run([sys.executable, "-m", "generate", "--manifest", str(manifest), "--corpus", str(corpus),
                             "--aux", str(built.aux_dir / AUX_FILE), "--out", str(tmp_path / "epochs"), "--workers",
                             "1"], cwd=ROOT, env=env_with_repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{path} is damaged" in errors[0] and "(read for shard epoch-" in errors[0], errors
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_a_stream_shorter_than_the_trainers_budget_is_refused_before_generation(built, tmp_path):
    """What the trainer of the same manifest would refuse (train.max_steps x batch_size rows), refused before
    the shards are paid for; allowed with train.allow_short_stream."""
    import dataclasses
    from common.config import ConfigError
    from generate.generator import check_inputs
    rows = load_corpus_meta(built.corpus_dir)["train"]["rows"]
    short = dataclasses.replace(built, generate=dataclasses.replace(built.generate, epochs=1, rows_per_epoch=10 * rows),
                                train=dataclasses.replace(built.train, max_steps=rows, batch_size=8))
    with pytest.raises(ConfigError, match=rf"generate.epochs 1 x {rows:,} rows \(rows_per_epoch {10 * rows:,} is more "
                                          rf"than the corpus's {rows:,} training rows\) is {rows:,} training rows; "
                                          rf"this manifest's trainer .* needs {8 * rows:,}"):
        check_inputs(short, built.corpus_dir, built.aux_dir / AUX_FILE, tmp_path / "epochs", force=False)
    allowed = dataclasses.replace(short, train=dataclasses.replace(short.train, allow_short_stream=True))
    assert check_inputs(allowed, built.corpus_dir, built.aux_dir / AUX_FILE, tmp_path / "epochs", False)["plan"]


def test_a_file_in_the_place_of_an_output_folder_or_a_damaged_stamp_file(tmp_path):
    from common.io import FolderLock, FolderLocked
    from generate.generator import VERIFIED_FILE, read_stamps
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FolderLocked, match=f"^cannot write {tmp_path / 'afile' / 'epochs'}: {tmp_path / 'afile'} is "
                                           "a file, not a folder$"):
        FolderLock(tmp_path / "afile" / "epochs", "python -m generate").acquire()
    for content in (b"\xff\xfe not utf-8", b"[1, 2]", b'{"epoch-000/shard-00000.parquet": ["ab", 1, 2'):
        (tmp_path / VERIFIED_FILE).write_bytes(content)
        assert read_stamps(tmp_path) == {}  # every shard is hashed again


def test_an_out_that_is_a_file_stops_each_stage_with_one_line_before_any_work(generated, tmp_path, capsys,
                                                                               env_with_repo):
    """`--out FILE` (a typo, a path reused): the stage's one line naming the file, exit 2, the file as it was;
    before, OS errors at the first write (the trainer's once its model and shards were loaded)."""
    from auxiliary.__main__ import main as aux_main
    from corpus.__main__ import main as corpus_main
    from finetune.__main__ import main as finetune_main
    manifest, data, _ = generated
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for main, args in ((corpus_main, ["--manifest", str(manifest)]), (aux_main, ["--manifest", str(manifest)]),
                       (finetune_main, ["--init", "none", "--manifest", str(manifest), "--task", str(tmp_path)])):
        assert main([*args, "--out", str(afile)]) == 2
        err = capsys.readouterr().err
        assert err == f"error: cannot write {afile}: {afile} is a file, not a folder\n", err
    result = subprocess.run([sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(data),
                             "--out", str(afile)], cwd=ROOT, env=env_with_repo, capture_output=True, text=True,
                            timeout=120)
    assert (result.returncode, result.stderr) == (2, f"error: cannot write {afile}: {afile} is a file, not a "
                                                     f"folder\n"), result.stderr[-3000:]
    assert afile.read_text() == "mine"


def test_the_corpus_stage_never_replaces_a_folder_that_is_no_corpus(built, tmp_path, capsys, monkeypatch):
    """A build publishes its folder whole (the old one moved aside and deleted): `--out` a folder of one's own
    is refused, its files kept; an empty folder, or `--out .` in one, is built."""
    from corpus.__main__ import main as corpus_main
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("precious")
    source = ["--manifest", str(built.corpus_dir / "resolved_manifest.toml"), "--source", str(built.corpus.source)]
    assert corpus_main([*source, "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {mine} is not empty and holds no corpus.json: not a corpus folder, and a build replaces "
                   f"its folder whole; give --out a new or empty folder\n"), err
    assert [p.name for p in mine.iterdir()] == ["thesis.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert corpus_main([*source, "--out", ".", "--workers", "1"]) == 0
    ours, reference = load_corpus_meta(empty), load_corpus_meta(built.corpus_dir)
    assert (ours["train"], ours["valid"]) == (reference["train"], reference["valid"])


def test_a_shard_read_that_fails_once_is_tried_again_and_one_that_keeps_failing_is_damage(generated, monkeypatch,
                                                                                         capsys):
    """A read error of the kind a network or file server gives (OSError) once: the rows as read without it, the
    failure said on stderr; on every try: the shard named as damaged after READ_TRIES tries. Opening the
    shard's footer likewise."""
    import pyarrow.parquet as pq
    from common import io as common_io
    from train import data as train_data
    _, data, _ = generated
    manifest = json.loads((data / "manifest.json").read_text())
    expected = train_data.training_stream(data, manifest).rows(0, 40)
    monkeypatch.setattr(common_io, "READ_BACKOFF_S", 0.0)
    real_read, real_open = pq.ParquetFile.read_row_group, train_data.open_parquet
    failures = {"read": 1, "open": 1}

    def flaky(kind, real):
        def call(*args, **kwargs):
            if failures[kind] > 0:
                failures[kind] -= 1
                raise OSError("AWS Error NETWORK_CONNECTION during GetObject operation: Timeout was reached")
            return real(*args, **kwargs)
        return call
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", flaky("read", real_read))
    monkeypatch.setattr(train_data, "open_parquet", flaky("open", real_open))
    got = train_data.training_stream(data, manifest).rows(0, 40)
    assert failures == {"read": 0, "open": 0}
    assert all(np.array_equal(a, b) for a, b in zip(got["input_ids"], expected["input_ids"]))
    assert np.array_equal(got["stream_index"], expected["stream_index"]) and len(got["input_ids"]) == 40
    assert capsys.readouterr().err.count("failed (OSError: AWS Error NETWORK_CONNECTION") == 2
    failures["read"] = common_io.READ_TRIES
    with pytest.raises(train_data.DataError, match=r"shard-\d+\.parquet: row group 0 .* is damaged: OSError"):
        train_data.training_stream(data, manifest).rows(0, 40)
    assert failures["read"] == 0


@pytest.mark.slow  # the session's generated folder (Ray)
@pytest.mark.parametrize("edit, said", [
    (lambda m: m["epochs"][0]["shards"][1].pop("rows"), "shard 1 of epoch 0: 'rows' None"),
    (lambda m: m["valid"]["shards"].__setitem__(0, "valid/shard-00000.parquet"), "shard 0 of valid: is no object"),
    (lambda m: m["epochs"][0]["shards"][0].update(bytes="12"), "shard 0 of epoch 0: 'bytes' '12'"),
    (lambda m: m["epochs"].__setitem__(0, []), "'epochs' is not a list of epochs")])
def test_a_manifest_whose_shard_entries_are_wrong_stops_the_trainer_with_one_line(generated, tmp_path, capsys, edit,
                                                                                  said):
    """A hand-edited or foreign manifest.json whose shard lists parse but are wrong: one line naming the file,
    the entry and the remedy (was a KeyError traceback)."""
    from train.__main__ import main as train_main
    manifest, data, _ = generated
    copy = shutil.copytree(data, tmp_path / "epochs")
    made = json.loads((copy / MANIFEST_FILE).read_text())
    edit(made)
    (copy / MANIFEST_FILE).write_text(json.dumps(made))
    assert train_main(["--manifest", str(manifest), "--data", str(copy), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {copy / MANIFEST_FILE}: {said}") and err.count("\n") == 1, err
    assert "make generate-epochs" in err, err


@pytest.mark.slow  # the session's generated folder (Ray)
def test_a_resume_whose_checkpoints_cannot_be_read_stops_and_keeps_the_runs_metrics(generated, tmp_path, monkeypatch,
                                                                                   capsys):
    """The trainer resuming where the file system fails every read of the checkpoints (EIO) stops naming the
    newest, after its retries; where every checkpoint is damaged it stops too: neither starts the run over, which
    rewrote metrics.jsonl (and, with EIO, went on from step 0 beside the step-4 file). A read failing once is
    tried again and the run resumes from its newest checkpoint."""
    import errno

    import torch

    from common import io as common_io
    from train.__main__ import main as train_main
    manifest, data, _ = generated
    run = tmp_path / "run"
    args = ["--manifest", str(manifest), "--data", str(data), "--out", str(run), "--set", "train.max_steps=4",
            "--set", "train.ckpt_every=2", "--set", "train.eval_every=2"]
    assert train_main(args) == 0
    metrics = (run / "metrics.jsonl").read_bytes()
    newest = run / "checkpoints" / "step-00000004.pt"
    assert newest.is_file()
    monkeypatch.setattr(common_io, "READ_BACKOFF_S", 0.0)
    real_load, failures = torch.load, {"left": 0, "calls": 0}

    def failing_load(*a, **k):
        failures["calls"] += 1
        if failures["left"] > 0:
            failures["left"] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return real_load(*a, **k)
    monkeypatch.setattr(torch, "load", failing_load)
    capsys.readouterr()

    failures["left"] = 10**6  # every read
    assert train_main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: checkpoint \S+step-00000004\.pt cannot be read \(OSError: \[Errno 5\] Input/output "
                     r"error\); not resuming from an older one or from the start", err), err
    assert failures["calls"] == common_io.READ_TRIES  # the newest only, tried READ_TRIES times; no older one
    assert err.count("checkpoints: reading") == common_io.READ_TRIES - 1
    assert (run / "metrics.jsonl").read_bytes() == metrics

    failures["left"], failures["calls"] = 1, 0  # one failed read: resumed from step 4 (the run's end)
    assert train_main([*args, "--resume"]) == 0
    out = capsys.readouterr()
    assert f"resumed from {newest} at step 4" in out.out and "checkpoints: reading" in out.err
    monkeypatch.setattr(torch, "load", real_load)

    metrics = (run / "metrics.jsonl").read_bytes()
    for path in (run / "checkpoints").glob("step-*.pt"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert train_main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "none of the 2 checkpoint(s)" in err and "step-00000004.pt" in err and "move them out" in err, err
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_a_host_out_of_memory_while_loading_is_no_damage(tmp_path, monkeypatch):
    """torch.load failing to allocate (a RuntimeError from its allocator) stops the caller with a MemoryError:
    it was counted a damaged file, skipped for an older checkpoint or none."""
    import torch
    from common.checkpoint import latest_checkpoint, save_checkpoint
    save_checkpoint({"step": 1, "model": {"w": torch.ones(4)}}, tmp_path, keep=3)
    save_checkpoint({"step": 2, "model": {"w": torch.ones(4)}}, tmp_path, keep=3)

    def out_of_memory(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 5217714176 bytes. Error code 12 (Cannot allocate memory)")
    monkeypatch.setattr(torch, "load", out_of_memory)
    with pytest.raises(MemoryError, match=r"loading \S+step-00000002\.pt: .*can't allocate memory"):
        latest_checkpoint(tmp_path)


def test_a_checkpoint_rotated_away_while_it_is_loaded_is_passed_over(tmp_path, monkeypatch):
    """An export or fine-tuning reading the folder of a run still writing it: the newest file, listed, is
    deleted by the run's pruning before it is read. The one before is taken (not "cannot be read")."""
    import torch
    from common import io as common_io
    from common.checkpoint import latest_checkpoint, save_checkpoint
    monkeypatch.setattr(common_io, "READ_BACKOFF_S", 0.0)
    for step in (1, 2):
        save_checkpoint({"step": step, "model": {"w": torch.full((4,), float(step))}}, tmp_path, keep=3)
    real_load = torch.load

    def rotated(path, *a, **k):
        if str(path).endswith("step-00000002.pt"):
            (tmp_path / "step-00000002.pt").unlink(missing_ok=True)
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_load(path, *a, **k)
    monkeypatch.setattr(torch, "load", rotated)
    path, state = latest_checkpoint(tmp_path)
    assert path.name == "step-00000001.pt" and state["step"] == 1


def test_checkpoints_load_into_shared_pages_not_a_copy_per_process(tmp_path):
    """A resume on a machine of 8 ranks held 8 copies of the checkpoint (about 5 GiB each at the large preset,
    optimizer moments included). Loaded the way the trainer does (latest_checkpoint, then load_state_dict), the
    process's own (anonymous) memory grows by a small part of the file: its pages are the page cache's."""
    import torch
    from common.checkpoint import save_checkpoint
    weights = {f"w{i}": torch.randn(1024, 1024) for i in range(16)}  # 64 MiB
    save_checkpoint({"step": 1, "model": weights}, tmp_path, keep=1)
    size = (tmp_path / "step-00000001.pt").stat().st_size
    probe = f"""
import torch
from common.checkpoint import latest_checkpoint
def anon():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon:')) * 1024
model = torch.nn.ParameterDict({{f"w{{i}}": torch.nn.Parameter(torch.zeros(1024, 1024)) for i in range(16)}})
before = anon()
path, state = latest_checkpoint({str(tmp_path)!r}, mmap=True)
model.load_state_dict(state["model"])
assert torch.equal(model["w3"], state["model"]["w3"])
print(anon() - before)
"""
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    grown = int(result.stdout.split()[-1])
    assert grown < 0.25 * size, (grown, size)
