"""Manifests: unknown keys and wrong types are errors; the resolved TOML reads back equal."""
import pytest

from common.config import ConfigError, config_from_dict, dump_toml, load_manifest
from tests.conftest import ROOT


@pytest.mark.parametrize("name", ["tiny", "base", "large"])
def test_checked_in_manifests_load_and_round_trip(name, tmp_path):
    config = load_manifest(ROOT / "manifests" / f"{name}.toml")
    path = tmp_path / "resolved.toml"
    path.write_text(dump_toml(config))
    assert load_manifest(path) == config


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"train\.learning_rate"):
        config_from_dict({"train": {"learning_rate": 1e-3}})
    with pytest.raises(ConfigError, match="colour"):
        config_from_dict({"colour": "blue"})


def test_wrong_type_and_bad_values_are_errors():
    with pytest.raises(ConfigError, match="train.batch_size must be int"):
        config_from_dict({"train": {"batch_size": "32"}})
    with pytest.raises(ConfigError, match="generate.epochs"):
        config_from_dict({"generate": {"epochs": -1}})
    with pytest.raises(ConfigError, match="temperature_granularity"):
        config_from_dict({"generate": {"temperature_granularity": "step"}})
    with pytest.raises(ConfigError, match="divisible"):
        config_from_dict({"model": {"hidden_size": 100, "num_heads": 3}})


@pytest.mark.parametrize("section, key, value, message", [
    ("model", "num_heads", 0, "model.num_heads must be >= 1, got 0"),  # was a ZeroDivisionError
    ("model", "hidden_size", -4, "model.hidden_size must be >= 1"),
    ("model", "num_layers", 0, "model.num_layers must be >= 1"),  # was an embeddings-only model, trained
    ("model", "rel_buckets", 2, "model.rel_buckets must be >= 4"),
    ("model", "rel_max_distance", 2, "rel_max_distance > rel_buckets / 4, got 32 and 2"),  # log(1) = 0 in the buckets
    ("train", "lr", -1.0, "train.lr must be a finite number > 0, got -1.0"),  # was torch's error after loading data
    ("train", "lr", float("nan"), "train.lr must be a finite number > 0, got nan"),
    ("train", "clip_norm", 0.0, r"train.clip_norm must be > 0 \(inf: no clipping\), got 0.0"),
    ("train", "clip_norm", float("nan"), "train.clip_norm must be > 0"),
    ("train", "electra_lambda", -1.0, "train.electra_lambda must be a finite number >= 0"),
    ("train", "weight_decay", -0.1, "train.weight_decay must be a finite number >= 0"),
    ("train", "max_steps", -3, "train.max_steps must be >= 0, got -3"),  # was a run of -3 steps that exited 0
    ("train", "warmup_steps", -1, "train.warmup_steps must be >= 0"),
    ("train", "max_nonfinite_steps", 0, "train.max_nonfinite_steps must be >= 1"),
    ("train", "compile", True, r"train.compile must be a string \(quoted in TOML\), got True"),
    ("aux", "lr", 0.0, "aux.lr must be a finite number > 0"),
    ("aux", "warmup_steps", -2, "aux.warmup_steps >= 0"),
    ("generate", "rows_per_shard", 0, "generate.rows_per_shard must be >= 1, got 0"),
    ("generate", "batch_tokens", 0, "generate.batch_tokens must be >= 1, got 0"),
    ("generate", "actors_per_gpu", 0, "generate.actors_per_gpu must be >= 1, got 0"),
    ("generate", "valid_rows", -1, "generate.valid_rows must be >= 0, got -1"),  # was a plan of no validation shard
    ("generate", "threads_per_worker", 0, "generate.threads_per_worker must be >= 1, got 0"),  # was found in an actor
    ("model", "rel_bias_locality", float("inf"), "model.rel_bias_locality must be a finite number >= 0, got inf"),
    ("model", "rel_bias_locality", float("nan"), "model.rel_bias_locality must be a finite"),  # was read as 0
    ("reproduce", "trainer_startup_s", float("nan"), "reproduce.trainer_startup_s and generation_startup_s must"),
])
def test_out_of_range_values_are_errors_naming_key_and_value(section, key, value, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({section: {key: value}})


def test_a_negative_seed_is_an_error():  # was a traceback in a Ray worker (corpus) or numpy (generate, aux)
    with pytest.raises(ConfigError, match="^seed must be >= 0, got -1$"):
        config_from_dict({"seed": -1})
    assert config_from_dict({"seed": 0}).seed == 0


def test_the_edges_of_the_ranges_still_load():
    config = config_from_dict({"train": {"clip_norm": float("inf"), "electra_lambda": 0.0, "weight_decay": 0.0,
                                         "warmup_steps": 0, "max_steps": 0}, "aux": {"warmup_steps": 0},
                               "model": {"rel_buckets": 4, "rel_max_distance": 2}})
    assert config.train.clip_norm == float("inf") and config.model.rel_buckets == 4


def test_a_table_given_a_value_is_an_error_naming_the_table():
    with pytest.raises(ConfigError, match=r"^train must be a table, got 1$"):
        config_from_dict({"train": 1})


def test_missing_manifest_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_manifest(tmp_path / "nope.toml")


def test_paper_hyper_parameters_in_base_and_large():
    for name, layers, width, aux_layers, buckets, distance in (("base", 12, 768, 4, 32, 128),
                                                               ("large", 24, 1024, 6, 128, 256)):
        c = load_manifest(ROOT / "manifests" / f"{name}.toml")
        assert (c.model.num_layers, c.model.hidden_size, c.aux.num_layers) == (layers, width, aux_layers)
        assert (c.model.rel_buckets, c.model.rel_max_distance) == (buckets, distance)
        assert (c.train.lr, c.train.betas, c.train.eps, c.train.weight_decay) == (1e-3, [0.9, 0.98], 1e-6, 0.01)
        assert (c.train.batch_size, c.train.max_steps, c.train.warmup_steps, c.train.clip_norm) == (2048, 125_000, 10_000, 2.0)
        assert (c.generate.t0, c.generate.tau, c.corpus.max_seq_len, c.tokenizer.vocab_size) == (2.0, 0.1, 512, 128_000)


def test_a_manifest_extends_another_table_by_table(tmp_path):
    (tmp_path / "base.toml").write_text('name = "base"\nseed = 5\n[train]\nlr = 0.002\nbatch_size = 64\n')
    (tmp_path / "child.toml").write_text('extends = "base.toml"\nname = "child"\n[train]\nbatch_size = 8\n')
    config = load_manifest(tmp_path / "child.toml")
    assert (config.name, config.seed, config.train.lr, config.train.batch_size) == ("child", 5, 0.002, 8)
    (tmp_path / "typo.toml").write_text('extends = "base.toml"\n[train]\nbatch_sise = 8\n')
    with pytest.raises(ConfigError, match="batch_sise"):
        load_manifest(tmp_path / "typo.toml")
    (tmp_path / "orphan.toml").write_text('extends = "nowhere.toml"\n')
    with pytest.raises(ConfigError, match="nowhere.toml does not exist .extended by"):
        load_manifest(tmp_path / "orphan.toml")
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="extends itself"):
        load_manifest(tmp_path / "a.toml")


def test_a_refused_value_names_the_manifest_and_where_the_key_was_set(tmp_path):
    """The error names the file given, and the file of the `extends` chain or the --set that gave the value."""
    (tmp_path / "base.toml").write_text("[train]\nlr = -1.0\n")
    (tmp_path / "child.toml").write_text('extends = "base.toml"\n[train]\nbatch_size = 8\n')
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'base.toml'}: train.lr must be a finite number > 0, got "
                                          r"-1.0$"):
        load_manifest(tmp_path / "base.toml")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'child.toml'}: train.lr .* \(set in "
                                          rf"{tmp_path / 'base.toml'}, which {tmp_path / 'child.toml'} extends\)$"):
        load_manifest(tmp_path / "child.toml")
    with pytest.raises(ConfigError, match=r"warmup_steps must be >= 0, got -3 \(set by --set train.warmup_steps=-3\)$"):
        load_manifest(tmp_path / "child.toml", ["train.lr=1e-3", "train.warmup_steps=-3"])
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'child.toml'}: unknown manifest key\(s\) train.batch_sise"
                                          r"; known in train: .* \(set by --set train.batch_sise=3\)$"):
        load_manifest(tmp_path / "child.toml", ["train.lr=1e-3", "train.batch_sise=3"])


def test_the_makefiles_work_folder_is_the_manifests_own_through_extends(tmp_path):
    """`make` finds the work folder with the standard library before the venv exists (common/work_dir.py):
    for every checked-in manifest and one that only extends another, what load_manifest resolves."""
    import subprocess
    import sys
    mine = tmp_path / "mine.toml"
    mine.write_text(f'extends = "{ROOT / "manifests" / "tiny.toml"}"\n[train]\nlr = 2e-3\n')
    manifests = [*sorted((ROOT / "manifests").rglob("*.toml")), mine]
    assert len(manifests) > 5
    for path in manifests:
        out = subprocess.run([sys.executable, str(ROOT / "common" / "work_dir.py"), str(path)], capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == load_manifest(path).work_dir, path
    probe = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import common.config; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'pyarrow', 'torch'}))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"  # the system's python3 runs it before the venv exists
    bad = tmp_path / "bad.toml"
    bad.write_text("work_dir = [")
    for path in (bad, tmp_path / "missing.toml"):
        result = subprocess.run([sys.executable, str(ROOT / "common" / "work_dir.py"), str(path)], capture_output=True,
                                text=True)
        assert (result.returncode, result.stdout) == (1, "")
    # make itself (a dry run): the extending manifest's folders, and a manifest that does not read stops it
    dry = subprocess.run(["make", "-n", "train", f"MANIFEST={mine}"], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0 and "--out work/tiny/runs/default" in dry.stdout, dry.stdout + dry.stderr
    # a DATA= given to make sweep is read as it is: a mistyped one never starts a generation there
    typo = tmp_path / "no-such-epochs"
    dry = subprocess.run(["make", "-n", "sweep", f"DATA={typo}"], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0 and f"--data {typo}" in dry.stdout and "generate" not in dry.stdout, dry.stdout
    # ... with the reason the manifest does not read, from the script make ran
    for path, reason in ((bad, "is not valid TOML"), (tmp_path / "missing.toml", "does not exist"),
                         (tmp_path, "is a folder, not a TOML file")):
        dry = subprocess.run(["make", "-n", "clean", f"MANIFEST={path}"], cwd=ROOT, capture_output=True, text=True)
        assert dry.returncode != 0 and f"MANIFEST={path}: manifest {path} {reason}" in dry.stderr, dry.stderr
        assert "rm -rf" not in dry.stdout


def test_make_train_generates_beside_its_trainer_with_one_actor_a_gpu():
    """base asks 4 generation actors a GPU (`make generate-epochs` alone: 1.7x one's speed); `make train`'s
    generator shares each GPU with the trainer, so it runs one whatever the manifest says (a dry run: on a CPU
    machine the setting is not used, so what make passes is the behaviour to check)."""
    import subprocess
    from common.config import load_manifest
    assert load_manifest(ROOT / "manifests" / "base.toml").generate.actors_per_gpu == 4
    def generator_lines(target: str) -> list[str]:
        dry = subprocess.run(["make", "-n", target, "MANIFEST=manifests/base.toml"], cwd=ROOT, capture_output=True,
                             text=True)
        return [line for line in dry.stdout.splitlines() if "-m generate " in line]
    beside, alone = generator_lines("train"), generator_lines("generate-epochs")
    assert len(beside) == 1 and "--set generate.actors_per_gpu=1" in beside[0], beside
    assert len(alone) == 1 and "actors_per_gpu" not in alone[0], alone


def test_make_targets_after_the_shards_use_the_work_folder_of_your_corpus(tmp_path):
    """`CORPUS=` (and `AUX=`) give everything made from them a work folder of its own: the targets that read
    shards, the corpus or the aux model (sweep, plots, finetune-floor) pass it on, as train does (a dry run)."""
    import subprocess
    corpus = tmp_path / "texts"
    dry = lambda target, *extra: subprocess.run(["make", "-n", target, f"CORPUS={corpus}", *extra], cwd=ROOT,
                                                capture_output=True, text=True)
    train = dry("train").stdout
    work = train.split("--set work_dir=")[1].split()[0]
    assert work.startswith("work/tiny/corpora/texts-") and f"--out {work}/runs/default" in train
    for target, expected in (("sweep", f"--set work_dir={work} --set shared_dir= --data {work}/epochs"),
                             ("plots", f"--set work_dir={work} --set shared_dir="),
                             ("finetune-floor", f"--corpus {work}/corpus --out {work}/finetune/rotten_tomatoes-none")):
        out = dry(target, "DATA=" if target != "sweep" else f"DATA={work}/epochs").stdout
        assert expected in " ".join(out.split()), (target, out)
    assert "--corpus" not in subprocess.run(["make", "-n", "finetune-floor"], cwd=ROOT, capture_output=True,
                                            text=True).stdout  # the manifest's own corpus (or its shared_dir)


def test_make_clean_says_what_it_deletes_until_yes_and_an_aux_path_with_a_slash_is_the_same_folder(tmp_path):
    """`make clean` deletes all of the work folder (hours to days at base): it says so and wants YES=1. `AUX=` with
    and without a trailing slash is one model, one work folder. `make export` replaces its own RUN/hf, never an
    EXPORT= folder (dry runs, but clean's)."""
    import subprocess
    work = tmp_path / "work"
    (work / "runs").mkdir(parents=True)
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'extends = "{ROOT / "manifests" / "tiny.toml"}"\nwork_dir = "{work}"\n')
    make = lambda *args: subprocess.run(["make", "--no-print-directory", *args, f"MANIFEST={manifest}"], cwd=ROOT,
                                        capture_output=True, text=True)
    result = make("clean")
    assert result.returncode != 0 and f"make clean deletes {work} (" in result.stderr, result.stderr
    assert "make clean YES=1 does it" in result.stderr and (work / "runs").is_dir()
    assert make("clean", "YES=1").returncode == 0 and not work.exists()
    folders = [make("-n", "corpus", f"AUX=hf:{tmp_path / 'models' / 'mlm'}{slash}").stdout.split("--set work_dir=")[1]
               .split()[0] for slash in ("", "/")]
    assert folders[0] == folders[1] and "/aux-models/mlm-" in folders[0], folders
    assert f"--out {work}/runs/default/hf --force" in make("-n", "export").stdout
    assert "--force" not in make("-n", "export", f"EXPORT={tmp_path / 'mine'}").stdout
