"""Weights & Biases logging (``logging.wandb``) in offline mode: the metrics of every step, the resolved config and
the run directory arrive in the W&B run files under the run directory, and a resume continues the same W&B run.

The offline run files are read back directly: a ``run-<id>.wandb`` file is W&B's transaction log (a LevelDB-style
log of 32 KiB blocks, each record a 7-byte header then a serialized ``wandb_internal_pb2.Record``)."""

import glob
import json
import os
import struct
import time

import pytest

from megatron_rlvr.config import (
    ConfigError,
    LoggingConfig,
    WandbConfig,
    build_section,
    load_run_config,
    resolved_dict,
)
from megatron_rlvr.rundir.metrics_log import WANDB_ID_FILE, RunLogger

wandb = pytest.importorskip("wandb")

BLOCK = 32 * 1024
FILE_HEADER = 7  # ":W&B", a 2-byte magic, a version byte
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path: str) -> list:
    """The records of an offline ``run-<id>.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pending, pos = [], b"", FILE_HEADER
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pending)
            records.append(rec)
    return records


def finished_records(path: str, timeout_s: float = 60.0) -> list:
    """The records of a finished run's file: W&B's writer process may still be writing it after ``finish()``
    returns, so wait for its exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_wandb_records(path)
        if records and records[-1].WhichOneof("record_type") == "exit" or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def offline_runs(run_dir: str) -> list[dict]:
    """Each offline W&B run under ``run_dir/wandb``, oldest first: id, project, name, config, history rows."""
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        run = {"history": [], "config": {}}
        for rec in finished_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run.update(id=rec.run.run_id, project=rec.run.project, name=rec.run.display_name)
                run["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "config":
                run["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
            elif kind == "history":
                run["history"].append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                )
        out.append(run)
    return out


def config_value(v):
    """W&B stores each config entry as {"value": ..., "desc": ...}."""
    return v["value"] if isinstance(v, dict) and "value" in v else v


@pytest.fixture
def no_wandb_env(monkeypatch):
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR", "WANDB_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_offline_run_records_metrics_config_and_run_dir_and_a_resume_continues_it(tmp_path, no_wandb_env):
    run_dir = str(tmp_path / "run")
    wandb_overrides = ["logging.wandb.enabled=true", "logging.wandb.mode=offline", "logging.wandb.project=rlvr-test"]
    run_cfg = load_run_config(None, ["logging.progress=false", "logging.tensorboard=off", *wandb_overrides])
    cfg = run_cfg.logging.wandb
    resolved = resolved_dict(run_cfg)

    log = RunLogger.for_run(run_cfg, run_dir, enabled=True)  # as the trainer makes it
    log.truncate_after(0)  # a fresh start
    log.log(1, {"reward/mean": 0.25, "loss/total": 1.5})
    log.log(2, {"reward/mean": 0.5, "loss/total": float("nan")})
    log.close()
    with open(os.path.join(run_dir, WANDB_ID_FILE)) as f:
        run_id = f.read().strip()

    log = RunLogger(run_dir, enabled=True, tensorboard="off", progress=False, wandb=cfg, run_name="tiny",
                    run_config=resolved)  # fmt: skip
    log.truncate_after(2)  # resumed from the step-2 checkpoint
    log.log(3, {"reward/mean": 0.75})
    log.close()

    first, resumed = offline_runs(run_dir)
    assert first["id"] == resumed["id"] == run_id
    assert (first["project"], first["name"]) == ("rlvr-test", run_cfg.logging.name)
    assert config_value(first["config"]["algorithm"]) == resolved["algorithm"]  # the whole resolved config
    assert config_value(first["config"]["logging"])["wandb"]["mode"] == "offline"
    assert config_value(first["config"]["run_dir"]) == os.path.abspath(run_dir)
    rows = [r for run in (first, resumed) for r in run["history"]]
    by_step = {r["_step"]: r for r in rows}
    assert sorted(by_step) == [1, 2, 3]
    assert by_step[1]["reward/mean"] == 0.25 and by_step[1]["loss/total"] == 1.5
    assert by_step[2]["reward/mean"] == 0.5 and "loss/total" not in by_step[2]  # non-finite values are left out
    assert by_step[3]["reward/mean"] == 0.75

    log = RunLogger(run_dir, enabled=True, tensorboard="off", progress=False, wandb=cfg, run_config=resolved)
    log.truncate_after(0)  # started over: a new W&B run
    log.log(1, {"reward/mean": 0.0})
    log.close()
    with open(os.path.join(run_dir, WANDB_ID_FILE)) as f:
        new_id = f.read().strip()
    assert new_id != run_id and new_id in {run["id"] for run in offline_runs(run_dir)}


def test_wandb_config_is_validated_and_off_by_default():
    assert LoggingConfig().wandb == WandbConfig(enabled=False)
    given = {"wandb": {"enabled": True, "mode": "offline", "project": "p"}}
    assert build_section(LoggingConfig, given, "logging").wandb == WandbConfig(
        enabled=True, project="p", mode="offline"
    )
    with pytest.raises(ConfigError, match="logging.wandb.mode must be one of online, offline, disabled"):
        build_section(LoggingConfig, {"wandb": {"mode": "ofline"}}, "logging")
    with pytest.raises(ConfigError, match="did you mean logging.wandb.project"):
        build_section(LoggingConfig, {"wandb": {"projet": "p"}}, "logging")


def test_a_missing_wandb_package_is_one_line_naming_logging_wandb(tmp_path, monkeypatch):
    import importlib.util
    import sys

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a)
    )
    with pytest.raises(ValueError) as e:
        LoggingConfig(wandb=WandbConfig(enabled=True)).check_files()  # the loader's check, before any rank starts
    assert "\n" not in str(e.value) and "logging.wandb" in str(e.value) and "pip install wandb" in str(e.value)
    LoggingConfig().check_files()  # off: nothing is required

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    log = RunLogger(str(tmp_path), enabled=True, tensorboard="off", progress=False, wandb=WandbConfig(enabled=True))
    with pytest.raises(ValueError, match=r"^logging\.wandb\.enabled=true but the wandb package is not installed"):
        log.log(1, {"reward/mean": 1.0})
