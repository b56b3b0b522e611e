"""What must not grow with the stream or the shard folder (docs/design.md, scale): the generator's plan,
the bytes a rank reads, the hashing at every start."""
import json
import shutil
import tracemalloc
from pathlib import Path

import numpy as np

from common.config import load_manifest
from common.plan import epoch_order, plan_tasks, stream_plan
from tests.conftest import ROOT


def test_the_base_plan_is_made_without_materialising_row_ids():
    """125,000 x 2,048 rows over a 16 GB corpus's 7.8M rows: 3,918 tasks of a few integers each. Measured
    with tracemalloc: about 2 MB for the whole plan (a materialised plan held ~6 GB: every epoch's
    permutation, float64 temperatures and gammas)."""
    config = load_manifest(ROOT / "manifests" / "base.toml")
    corpus_rows = 16 * 10**9 // 4 // 510
    plan = stream_plan(corpus_rows, config)
    tracemalloc.start()
    tasks = plan_tasks(corpus_rows, 10_000, config.generate, config.seed, plan.total_rows)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(t.count for t in tasks if t.split == "train") == 125_000 * 2048
    assert peak < 16 * 2**20, peak
    task = tasks[len(tasks) // 2]  # what an actor derives for one task: its rows, from the seeded order
    ids = task.row_ids
    assert len(ids) == task.count == 65_536 and len(set(ids.tolist())) == len(ids)
    assert np.array_equal(ids, epoch_order(corpus_rows, task.epoch, config.seed)(task.first + np.arange(task.count)))
    temperatures, gammas = task.curriculum()
    assert np.all(np.diff(temperatures) < 0) and np.allclose(temperatures, 1 + gammas)  # decaying along the stream


def test_each_rank_reads_and_decompresses_only_the_row_groups_of_its_rows(tmp_path):
    from bench.scale import write_shard_folder
    from train.data import ShardStream, rank_slice
    # shards of 1,024 rows: each stream reads every file's footer and metadata whatever its share, and with
    # shards of 64 rows that fixed part made a rank's reads 0.75 of the whole stream's (the kernel's count),
    # while the streams' own counts of row-group bytes said half
    write_shard_folder(tmp_path, shards=2, rows_per_shard=1024, row_group=32, seq_len=512, zstd_level=3)
    records = json.loads((tmp_path / "records.json").read_text())
    streams = [ShardStream(tmp_path, records) for _ in range(3)]  # rank 0 and 1 of 2, and one rank alone
    rchar = [0, 0, 0]  # what the kernel counted as read by this process (pyarrow reads on its own threads), beside the streams' own counts

    def read(k, *rows):
        before = _rchar()
        out = streams[k].rows(*rows)
        rchar[k] += _rchar() - before
        return out
    for step in range(2048 // 64):
        for rank in range(2):
            mine = read(rank, *rank_slice(step, 64, rank, 2))
            assert mine["stream_index"].tolist() == list(range(64 * step + 32 * rank, 64 * step + 32 * rank + 32))
        read(2, *rank_slice(step, 64, 0, 1))
    whole = streams[2]
    for rank in range(2):
        assert streams[rank].bytes_decompressed / whole.bytes_decompressed <= 0.55
        assert streams[rank].bytes_read / whole.bytes_read <= 0.55
        assert rchar[rank] / rchar[2] <= 0.55, rchar  # a stream that read whole files would count its own way


def _rchar() -> int:
    return int(next(l.split()[1] for l in Path("/proc/self/io").read_text().splitlines()
                    if l.startswith("rchar:")))


def test_a_complete_folder_is_not_hashed_again_unless_asked(generated, tmp_path, monkeypatch):
    """The generator's check of a complete folder reads no shard whose size and time are those recorded
    when it was last hashed (verified.json); `--verify` hashes every one; a touched shard is hashed."""
    import generate.generator as generator
    manifest, data, _ = generated
    copy = tmp_path / "epochs"
    shutil.copytree(data, copy)  # copy2: sizes and times kept
    config = load_manifest(manifest)
    hashed = []
    real = generator.sha256_file
    monkeypatch.setattr(generator, "sha256_file", lambda p: (hashed.append(Path(p).name), real(p))[1])
    shards = len(list(copy.glob("*/*.parquet")))

    def check(verify=False):
        hashed.clear()
        generator.generate(config, copy, config.corpus_dir, config.aux_dir / "aux.pt", 1, verify=verify,
                           log=lambda *_: None)
        return [name for name in hashed if name.endswith(".parquet")]
    assert check() == []
    assert len(check(verify=True)) == shards
    touched = next(copy.glob("epoch-000/*.parquet"))
    touched.write_bytes(touched.read_bytes())  # same bytes, a new time: hashed once more, then trusted
    assert check() == [touched.name] and check() == []
