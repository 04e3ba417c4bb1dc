"""A full disk met while writing: what is left on disk and what the user sees. The full disk is an OSError(ENOSPC)
raised in-process by the write function (after part of the file was written, as a real short write leaves it)."""

import errno
import json
import os
import re

import pytest
import torch

from megatron_rlvr.models import lora


def _full_disk_after_64_bytes(tensors, path, metadata=None):
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    raise OSError(errno.ENOSPC, "No space left on device")


def _tree(root):
    """Every file under ``root`` with its bytes (folders too, as None)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root)] = None
        for n in files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def test_a_peft_export_on_a_full_disk_leaves_nothing_or_the_previous_export(tmp_path, monkeypatch):
    """A LoRA adapter export whose weight file cannot be written: a new output folder (and the parent folders the
    export made) is not left behind, empty or half-written; over a previous complete export, that export is left
    byte for byte (the old code removed its files, or wrote into the folder in place and left it half-written). A
    write that succeeds replaces the previous export and leaves no temporary folder."""
    import safetensors.torch

    tensors = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.arange(6.0).reshape(2, 3)}
    config = {"r": 2, "lora_alpha": 4}
    runs = tmp_path / "runs"
    runs.mkdir()
    real_save = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", _full_disk_after_64_bytes)

    new = runs / "new" / "adapter"  # its parent does not exist yet either
    err = lora.write_peft_folder(tensors, config, str(new))
    assert err and f"cannot write the LoRA adapters to {new}" in err and "No space left on device" in err, err
    assert "nothing was left there" in err and "\n" not in err
    assert _tree(runs) == {}, _tree(runs)

    old = runs / "adapter"
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    assert lora.write_peft_folder(tensors, config, str(old)) is None
    before = _tree(runs)
    assert sorted(before) == ["adapter", f"adapter/{lora.PEFT_CONFIG}", f"adapter/{lora.PEFT_WEIGHTS}"], before
    monkeypatch.setattr(safetensors.torch, "save_file", _full_disk_after_64_bytes)
    err = lora.write_peft_folder({k: v + 1 for k, v in tensors.items()}, {"r": 2, "lora_alpha": 8}, str(old))
    assert err and "the previous export there is unchanged" in err, err
    assert _tree(runs) == before

    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    assert lora.write_peft_folder({k: v + 1 for k, v in tensors.items()}, {"r": 2, "lora_alpha": 8}, str(old)) is None
    assert sorted(_tree(runs)) == sorted(before)
    assert json.loads((old / lora.PEFT_CONFIG).read_text())["lora_alpha"] == 8
    got = safetensors.torch.load_file(str(old / lora.PEFT_WEIGHTS))
    assert torch.equal(got["base_model.model.layers.0.q_proj.lora_A.weight"], tensors[next(iter(tensors))] + 1)


def test_a_full_disk_during_a_save_shows_one_line_and_keeps_the_writers_lines_in_the_traceback_file(
    tmp_path, monkeypatch, capsys, caplog
):
    """A checkpoint save on a full disk: megatron's writer logged ``Local process 0 encountered an error: [Errno 28]
    No space left on device`` (once per rank) above the checkpointer's one-line error. Now the user sees that one line
    only; it names a traceback file, which holds the writer's lines and the traceback. The writer's warnings still
    pass, and its errors print again once the save is over."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_rlvr.commands import cli
    from megatron_rlvr.models import checkpointing
    from megatron_rlvr.rundir import checkpointer as ckpt

    writer = "megatron.core.dist_checkpointing.strategies.filesystem_async"
    line = "Local process 0 encountered an error: [Errno 28] No space left on device"

    def full_disk(cfg, step, **kw):  # what megatron's writer does inside the save on a full disk
        with checkpointing.writer_errors_held():
            import logging

            logging.getLogger(writer).warning("a warning the user should see")
            logging.getLogger(writer).error(line)
            raise CheckpointException("save failed", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})

    monkeypatch.setattr(checkpointing, "save_checkpoint", full_disk)
    section = SimpleNamespace(keep_last=2, sharding_type="fully_reshardable", save_every=5)
    saver = ckpt.Checkpointer(str(tmp_path / "run"), section, pg=None, rank=0, algorithm="grpo", last_step=20)
    policy = ckpt.PolicyState(model=None, optimizer=None, scheduler=None, args=None)
    with pytest.raises(ckpt.CheckpointSaveError) as e:
        saver.save(10, policy, SimpleNamespace(state_dict=dict))
    assert [r.getMessage() for r in caplog.records] == ["a warning the user should see"]
    cli._report("train", e.value)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device [ENOSPC]" in err[0] and "Errno 28" not in err[0], err
    found = re.search(r"\(traceback in (\S+\.traceback\.txt)\)$", err[0])
    assert found, err
    kept = open(found.group(1)).read()
    os.remove(found.group(1))
    assert f"{writer}: {line}" in kept and "Traceback" in kept and "CheckpointException" in kept, kept
    import logging

    logging.getLogger(writer).error(line)  # outside a save: logged as before
    assert [r.getMessage() for r in caplog.records][-1] == line


def test_the_hf_export_stops_writing_at_a_full_disk_but_reads_its_stream_to_the_end(tmp_path, monkeypatch):
    """A merged HF export on a full disk: the shard write that fails is reported as one line and its partial file
    removed, no later shard is written, and the (collective) tensor stream is still read to its end, so the rank's
    TP peers are not left waiting in a gather. Before, the safetensors error escaped mid-stream and left an empty
    output folder behind (``convert to-hf`` on a full tmpfs)."""
    import safetensors.torch

    from megatron_rlvr.models import export

    real_save = safetensors.torch.save_file
    writes = []

    def full_after_one_shard(tensors, path, metadata=None):
        writes.append(path)
        if len(writes) == 1:
            return real_save(tensors, path, metadata=metadata)
        return _full_disk_after_64_bytes(tensors, path, metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_after_one_shard)
    read = []

    def stream():
        for i in range(6):
            read.append(i)
            yield f"t{i}", torch.full((4,), float(i))

    files, err = export._write_temp_shards(stream(), str(tmp_path), 0, torch.float32, 32, writer=True)
    assert read == list(range(6)) and len(writes) == 2, (read, writes)
    assert err == "OSError: [Errno 28] No space left on device", err
    assert [names for _, names, _ in files] == [["t0", "t1"]]
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(files[0][0])]


def test_a_safetensors_full_disk_error_is_a_user_error(monkeypatch, capsys):
    """safetensors reports a full disk as ``SafetensorError: Error while serializing: I/O error: No space left on
    device (os error 28)``, an exception without errno: ``convert`` took the unexpected-error path (exit 1 and a
    traceback file). Now it is one line saying what to do, exit 2."""
    from megatron_rlvr.commands import cli, convert_cli

    SafetensorError = type("SafetensorError", (Exception,), {})

    def full(argv):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(convert_cli, "convert_main", full)
    assert cli.main(["convert", "to-hf", "--ckpt", "x", "--out", "y"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device (os error 28); free space" in err[0], err
    assert "traceback" not in err[0] and err[0].count("No space left") == 1, err


def test_an_hf_export_over_a_previous_one_keeps_it_until_the_new_shards_are_all_written(tmp_path, monkeypatch):
    """The run's final HF export overwrites the previous one (``overwrite=True``). A full disk while the new shards
    are written leaves the previous export byte for byte (the old code deleted its weight files before writing, so a
    full disk at the end of a run lost both). Once every new shard is written, the new export replaces the old one
    whole: the old shards that no new file replaces (3 shards before, 2 after) and its index are gone."""
    import safetensors.torch
    from transformers import LlamaConfig

    from megatron_rlvr.models import export
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import SAFE_INDEX
    from megatron_rlvr.models.mapping import WeightMapping, checkpoint_names

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      architectures=["LlamaForCausalLM"])  # fmt: skip
    args = megatron_model_args(cfg.to_dict())
    names = sorted(checkpoint_names(WeightMapping(args.dims).hf_names()))
    out = tmp_path / "hf"
    out.mkdir()
    for i in range(3):  # the previous export: 3 shards, an index, a config
        safetensors.torch.save_file(
            {f"old{i}": torch.full((2,), float(i))}, str(out / f"model-{i + 1:05d}-of-00003.safetensors")
        )
    (out / SAFE_INDEX).write_text("{}")
    (out / "config.json").write_text("{}")
    before = _tree(out)

    assert export._prepare_out_dir(str(out), overwrite=False).startswith(f"{out} already holds an HF checkpoint")
    assert export._prepare_out_dir(str(out), overwrite=True) is None
    assert _tree(out) == before

    def stream(value):
        return ((n, torch.full((4,), value)) for n in names)

    real_save = safetensors.torch.save_file
    writes = []

    def full_after_one_shard(tensors, path, metadata=None):
        writes.append(path)
        if len(writes) == 1:
            return real_save(tensors, path, metadata=metadata)
        return _full_disk_after_64_bytes(tensors, path, metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_after_one_shard)
    shard_bytes = 16 * (len(names) // 2 + 1)  # two shards
    files, err = export._write_temp_shards(stream(1.0), str(out), 0, torch.float32, shard_bytes, writer=True)
    assert err and "No space left on device" in err
    export._discard_partial_export(str(out), created=False)
    assert _tree(out) == before

    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    files, err = export._write_temp_shards(stream(2.0), str(out), 0, torch.float32, shard_bytes, writer=True)
    assert err is None and len(files) == 2
    export._finalise(files, str(out), args, torch.float32, None)
    weights = sorted(f for f in os.listdir(out) if f.startswith("model"))
    assert weights == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", SAFE_INDEX], weights
    got = {}
    for f in weights[:2]:
        got.update(safetensors.torch.load_file(str(out / f)))
    assert sorted(got) == names and all(torch.equal(t, torch.full((4,), 2.0)) for t in got.values())
    assert sorted(json.loads((out / SAFE_INDEX).read_text())["weight_map"]) == names
