"""The `electra` objective (paper section 2): it learns, and the shared embeddings stay shared."""

import numpy as np
import pytest
import torch

from common.checkpoint import AUX_FILE, latest_checkpoint
from common.config import load_manifest
from common.corrupt import Corruptor
from tests.conftest import train_with
from common.batching import masked_inputs
from train.objectives import ElectraPair
from train.online import OnlineStream

SHARED = ("encoder.embed.weight", "encoder.ln_embed.weight", "encoder.ln_embed.bias")


def test_generator_has_the_aux_models_depth_and_shares_the_embeddings(built):
    """Paper appendix A: ELECTRA's generator and the aux model have one size (base 4 layers, large 6)."""
    pair = ElectraPair(built.model, 320, built.aux.num_layers)
    assert len(pair.generator.encoder.layers) == built.aux.num_layers == 2
    for name in SHARED:
        assert pair.generator.get_parameter(name) is pair.discriminator.get_parameter(name)
    assert pair.generator.head.embedding.weight is pair.discriminator.encoder.embed.weight
    names = [n for n, _ in pair.named_parameters()]
    assert len(names) == len(set(id(p) for p in pair.parameters()))  # each shared tensor counted once


def test_masking_matches_the_generators_rows(built, generated):
    """ELECTRA masks the very positions generate/ masks for the same (seed, epoch, row)."""
    manifest_path, data, _ = generated
    config = load_manifest(manifest_path)
    stream = OnlineStream(config, built.corpus_dir, None)
    rows = stream.rows(0, 8)
    batch = masked_inputs(rows["input_ids"], rows["row_id"], rows["epoch"], config.seed, 0.15, 32)
    from train.data import load_data_manifest, training_stream
    shards = training_stream(data, load_data_manifest(data, config)[0]).rows(0, 8)
    for i, label in enumerate(shards["labels"]):  # every replaced position of the shard is masked here
        assert batch["masked_flags"][i, :len(label)][torch.from_numpy(label)].all()
        assert np.array_equal(batch["original_ids"][i, :len(label)].numpy(), rows["input_ids"][i])
    # and exactly generate/'s draws: positions and sampling uniforms of its Corruptor, row by row
    corruptor = Corruptor.from_config(config.aux_dir / AUX_FILE, config.seed, config.generate, built.corpus_dir)
    assert np.all(np.asarray(rows["epoch"]) == 0)
    positions, uniforms, _ = corruptor.masked_batches(rows["input_ids"], rows["row_id"], 0)
    assert sum(len(p) for p in positions) > 0
    for i, pos in enumerate(positions):
        assert np.array_equal(torch.nonzero(batch["masked_flags"][i]).flatten().numpy(), pos)
    assert torch.equal(batch["uniforms"], torch.from_numpy(np.concatenate(uniforms)))
    # its generator samples at T = 1, and so its rows (and the run's logged temperatures) say, at any step
    late = stream.rows(stream.num_rows - 8, stream.num_rows)
    assert np.array_equal(rows["temperature"], np.ones(8, np.float32)) and (late["temperature"] == 1).all()


@pytest.mark.slow
def test_electra_objective_learns_and_its_checkpoint_keeps_the_sharing(built, generated, tmp_path, env_with_repo):
    _, records = train_with(built, generated[0], tmp_path, env_with_repo, objective="electra", lr=2e-3, max_steps=40,
                            eval_every=20, ckpt_every=20, warmup_steps=4, embed_lr_scale=1.0)
    run, path = tmp_path / "run", tmp_path / "variant.toml"
    assert len(records) == 40
    first, last = records[:8], records[-8:]
    mean = lambda rs, k: float(np.mean([r[k] for r in rs]))
    assert mean(last, "generator_mlm_loss") < mean(first, "generator_mlm_loss") - 0.5
    assert mean(last, "generator_top1") > mean(first, "generator_top1") + 0.02
    assert mean(last, "loss") < mean(first, "loss")  # the discriminator's RTD loss falls too

    _, state = latest_checkpoint(run / "checkpoints")
    for name in SHARED:  # saved once: both names point at one storage
        assert state["model"][f"generator.{name}"].data_ptr() == state["model"][f"discriminator.{name}"].data_ptr()
    pair = ElectraPair(load_manifest(path).model, 320, load_manifest(path).aux.num_layers)
    pair.load_state_dict(state["model"])
    for name in SHARED:  # one parameter for both, with the saved values
        assert pair.generator.get_parameter(name) is pair.discriminator.get_parameter(name)
        assert torch.equal(pair.discriminator.get_parameter(name), state["model"][f"discriminator.{name}"])


def test_an_hf_tokenizers_reserved_ids_are_never_masked_nor_sampled_by_the_generator(built):
    """An hf: tokenizer numbers its other special and [unusedN] entries last (common.tokenizer.Reserved):
    a literal [unusedN] in the text is never masked, and ELECTRA's generator never samples one, even when
    its head prefers it above everything."""
    import numpy as np
    import torch
    from common.curriculum import choose_masked_positions, masked_count, num_to_mask, row_rng
    from common.tokenizer import Reserved
    from train.objectives import electra_tensors
    vocab, reserved = 320, Reserved(head=5, tail=20)  # ids 300..319 reserved
    rows = [np.array([2, *range(290, 310), *range(5, 25), 3], dtype=np.int32) for _ in range(4)]
    for r in rows[:1]:
        positions = choose_masked_positions(r, 0.5, row_rng(1, 0, 0), reserved, vocab)
        assert len(positions) == num_to_mask(30, 0.5) and not np.isin(r[positions], np.arange(300, 320)).any()
    assert masked_count(rows, 0.15, reserved, vocab) == 4 * num_to_mask(30, 0.15)
    pair = ElectraPair(built.model, vocab, built.aux.num_layers, reserved).eval()
    with torch.no_grad():
        pair.generator.head.bias[vocab - 1] = 1e4  # the generator would sample the last id every time
    captured = []
    real = pair.discriminator.forward
    pair.discriminator.forward = lambda ids, attn: (captured.append(ids), real(ids, attn))[1]
    batch = electra_tensors({"input_ids": rows, "row_id": np.arange(4), "epoch": np.zeros(4, int)}, 1, 0.15,
                            reserved, vocab)
    with torch.no_grad():
        pair(*(batch[k] for k in ("masked_ids", "attention_mask", "masked_flags", "original_ids", "uniforms")))
    sampled = captured[0][batch["masked_flags"]]
    assert len(sampled) == 4 * num_to_mask(30, 0.15) and int(sampled.max()) < 300
