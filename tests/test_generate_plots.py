"""`make plots`: the schedules and the section 5.1 figure of replaced-token distributions, as PNG."""
import numpy as np

from common.checkpoint import AUX_FILE, load_aux
from common.config import dump_toml
from common.corpus import term_counts
from common.tokenizer import SPECIAL_IDS, Tokenizer
from generate.plots import example_distributions, main


def test_example_distributions_are_the_generators_and_ranked_by_frequency(built):
    model, _ = load_aux(built.aux_dir / AUX_FILE)
    counts = term_counts(built.corpus_dir)
    example = example_distributions(model, Tokenizer(built.corpus_dir / "tokenizer.model"), counts,
                                    temperatures=(1.0, 3.0), alpha=0.35)
    dists = example["distributions"]
    assert len(dists) == 5
    for name, probs in dists.items():
        assert probs.dtype == np.float32 and abs(float(probs.sum()) - 1.0) < 1e-5, name
        assert (probs[list(SPECIAL_IDS)] == 0).all(), name
    original = example["original"]
    assert original not in SPECIAL_IDS
    assert abs(dists["smoothed one-hot (alpha = 0.35)"][original] - 0.65) < 1e-6
    rank = example["rank"]
    assert sorted(rank.tolist()) == list(range(len(SPECIAL_IDS), len(counts)))
    assert np.all(np.diff(counts[rank]) <= 0)  # most frequent first
    hot, cold = dists["aux model, T = 1"], dists["aux model, T = 3"]
    assert hot.max() > cold.max()  # a higher temperature is flatter


def test_make_plots_writes_two_pngs(built, tmp_path):
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(built))
    assert main(["--manifest", str(manifest), "--out", str(tmp_path / "plots")]) == 0
    for name in ("schedules.png", "replaced_token_distributions.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert main(["--manifest", str(manifest), "--aux", str(tmp_path / "none.pt")]) == 2
    # --set (make's CORPUS= and AUX= pass their work folder so): read from and written to where it says
    moved = tmp_path / "moved"
    assert main(["--manifest", str(manifest), "--set", f"work_dir={moved}", "--set", f"shared_dir={built.work_dir}"]) == 0
    assert (moved / "plots" / "schedules.png").is_file()
    assert main(["--manifest", str(manifest), "--set", f"shared_dir={tmp_path / 'empty'}"]) == 2  # no corpus there
