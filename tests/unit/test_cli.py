"""The ``megatron-rlvr`` command line without starting ranks: config validation before launch (exit 2 with the
offending key / file / line), the resolved config in the run directory, malformed data rows, and the plan / plot /
eval / convert subcommands' argument handling."""

import json
import os

import pytest
import yaml

from megatron_rlvr.commands.cli import main


def _train(tmp_path, *args):
    return main(["train", *args, f"logging.run_dir={tmp_path / 'run'}", "--dry-run"])


def test_dry_run_writes_the_resolved_config_that_reloads(tmp_path, capsys):
    assert _train(tmp_path, "schedule.steps=3", "algorithm.preset=cispo") == 0
    path = tmp_path / "run" / "config.yaml"
    resolved = yaml.safe_load(path.read_text())
    assert resolved["schedule"]["steps"] == 3 and resolved["algorithm"]["name"] == "cispo"
    assert resolved["logging"]["run_dir"] == str(tmp_path / "run")
    assert resolved["algorithm"]["policy_loss"]["name"] == "cispo"  # every default expanded
    assert "config OK: 2 rank(s)" in capsys.readouterr().out
    # a run directory is accepted in place of its config.yaml (that is how a run is resumed)
    assert main(["train", str(tmp_path / "run"), "--dry-run"]) == 0


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.learning_rate=1", "unknown config key 'optimizer.learning_rate'"),
        ("parallel.tp=3", "does not divide the world size 2"),
        ("launch.nproc=3", "does not divide the world size 3"),
        ("model.hf_path=/nonexistent/model", "model.hf_path: not found: /nonexistent/model"),
    ],
)
def test_invalid_config_exits_2_before_any_rank_starts(tmp_path, capsys, override, message):
    assert _train(tmp_path, override) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("megatron-rlvr train: error:")
    assert not (tmp_path / "run").exists()  # nothing was written, nothing was launched


def _write_rows(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")


def test_the_vllm_engine_without_vllm_is_refused_by_the_dry_run(tmp_path, capsys, monkeypatch):
    """``rollout.engine=vllm`` on a machine without vLLM: one line naming the option and what to install or use
    instead, exit 2, from ``--dry-run`` and before any rank starts (a bare ``ImportError`` in every rank, after
    launch, was the report of a run that passed its dry run); the same option with vLLM present passes."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert _train(tmp_path, "rollout.engine=vllm") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout.engine=vllm but vLLM is not installed" in err[0], err
    assert "rollout.engine=hf" in err[0] and not (tmp_path / "run").exists()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: real("json") if name == "vllm" else real(name))
    assert _train(tmp_path, "rollout.engine=vllm") == 0


def test_malformed_data_row_is_named_or_skipped(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    _write_rows(data, [{"problem": "1+1=", "answer": "2"}, {"problem": "2+2=", "answer": "4"}, "{not json", {"x": 1}])
    assert _train(tmp_path, f"data.train_files=[{data}]") == 2
    err = capsys.readouterr().err
    assert f"{data}:3: invalid JSON" in err  # file and line of the first bad row
    assert _train(tmp_path, f"data.train_files=[{data}]", "data.skip_malformed=true") == 0


def test_plot_writes_a_png_and_overlays_runs(tmp_path, capsys):
    for name, slope in (("a", 0.01), ("b", 0.02)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"name": f"algo_{name}"}}))
        _write_rows(
            d / "metrics.jsonl",
            [
                {"step": s, "reward/mean": slope * s, "loss/entropy": 2 - slope * s, "groups/mastered_frac": 0.1}
                for s in range(1, 21)
            ],
        )
    assert main(["plot", str(tmp_path / "a")]) == 0
    png = tmp_path / "a" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = tmp_path / "cmp.png"
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path / "nothing-here")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_plot_has_the_async_panels_only_for_a_disaggregated_run(tmp_path):
    from megatron_rlvr.rundir.plot import panels_of, plot_runs, read_run

    k = 2
    rows = []
    for s in range(1, 13):
        fracs = [0.2, 0.3, 0.5] if s > 2 else [1.0, 0.0, 0.0]
        row = {"step": s, "reward/mean": 0.05 * s, "async/staleness_mean": sum(j * f for j, f in enumerate(fracs))}
        row.update({f"async/staleness_frac_{j}": f for j, f in enumerate(fracs)})
        row.update({"async/staleness_max": float(k if s > 2 else 0), "async/dropped_samples": 0.0})
        row.update({"async/trainer_wait_s": 0.1, "async/rollout_wait_s": 0.3, "async/policy_version": s - 1.0})
        row.update({"async/rollout_version": max(s - 1.0 - k, 0.0), "sync/time_s": 0.05, "sync/gbytes": 0.002})
        row.update({"sync/gbps": 0.04, "sync/apply_s": 0.01, "async/sample_version_min": max(s - 1.0 - k, 0)})
        rows.append(row)
    async_dir, colocated_dir = tmp_path / "async", tmp_path / "colocated"
    for d, recs in (
        (async_dir, rows),
        (colocated_dir, [{"step": r["step"], "reward/mean": r["reward/mean"]} for r in rows]),
    ):
        d.mkdir()
        _write_rows(d / "metrics.jsonl", recs)
    panels = dict(panels_of([read_run(str(async_dir))]))
    assert [key for key, _ in panels["staleness breakdown (fraction of trained samples per age)"]] == [
        f"async/staleness_frac_{j}" for j in range(k + 1)
    ]
    assert [key for key, _ in panels["idle time per step (s)"]] == ["async/trainer_wait_s", "async/rollout_wait_s"]
    for title in ("staleness of trained samples (updates behind the trained policy)", "weight version"):
        assert title in panels
    assert {key for key, _ in panels["weight sync volume"]} == {"sync/gbytes", "sync/gbps"}
    assert [key for key, _ in panels["samples dropped / generations spanning a weight update"]] == [
        "async/dropped_samples"
    ]
    colocated = dict(panels_of([read_run(str(colocated_dir))]))
    assert list(colocated) == ["training reward"]  # no empty async panels on a colocated run
    png = plot_runs([str(async_dir)])
    assert png.endswith("curves.png") and os.path.getsize(png) > 10_000
    # overlaid with the colocated run, the async panels stay (one run has them)
    assert "weight version" in dict(panels_of([read_run(str(async_dir)), read_run(str(colocated_dir))]))


def test_plot_has_agent_panels_only_for_multi_turn_runs(tmp_path):
    """A run that logged the agent metrics (multi-turn rollouts) gets the two agent panels with exactly the keys it
    logged, drawn into curves.png; a single-turn run gets neither."""
    from megatron_rlvr.rundir.plot import panels_of, plot_runs, read_run

    agent = {
        "agent/turns_mean": 2.0,
        "agent/tool_calls_per_trajectory": 1.0,
        "agent/observation_token_frac": 0.3,
        "agent/tool_errors": 3.0,
        "agent/malformed_calls": 1.0,
    }
    multi, single = tmp_path / "multi", tmp_path / "single"
    for d, extra in ((multi, agent), (single, {})):
        d.mkdir()
        _write_rows(d / "metrics.jsonl", [{"step": s, "reward/mean": 0.1 * s, **extra} for s in range(1, 6)])
    panels = dict(panels_of([read_run(str(multi))]))
    assert [k for k, _ in panels["agent: turns, tool calls and observation share (per trajectory)"]] == [
        "agent/turns_mean",
        "agent/tool_calls_per_trajectory",
        "agent/observation_token_frac",
    ]
    failed = panels["agent: failed tool calls (per step)"]
    assert [k for k, _ in failed] == ["agent/tool_errors", "agent/malformed_calls"]
    assert not [t for t, _ in panels_of([read_run(str(single))]) if t.startswith("agent")]
    png = plot_runs([str(multi)])
    assert os.path.getsize(png) > 10_000


def test_plot_title_sits_above_the_panel_titles(tmp_path, monkeypatch):
    """The figure title of curves.png overlapped the first row of panel titles (``tight_layout`` leaves the
    suptitle out: on a tall figure of many panels it sat on the first row); its drawn box must lie above every panel
    title's, for one panel and for every panel there is."""
    import matplotlib.figure

    from megatron_rlvr.rundir.plot import PANELS, plot_runs

    boxes = []  # (figure title, panel titles) as drawn into the PNG
    real_savefig = matplotlib.figure.Figure.savefig

    def keep(fig, *a, **k):
        out = real_savefig(fig, *a, **k)
        renderer = fig.canvas.get_renderer()
        panels = [ax.title.get_window_extent(renderer) for ax in fig.axes if ax.get_title()]
        boxes.append((fig._suptitle.get_window_extent(renderer), panels))
        return out

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    one = [{"step": s, "reward/mean": 0.1 * s} for s in range(1, 9)]
    every = [key for _, keys in PANELS for key, _ in keys]  # every panel: a tall figure (a long run's curves.png)
    many = [{**r, **{k: 1.0 / r["step"] for k in every}} for r in one]
    for name, recs in (("one", one), ("many", many)):
        d = tmp_path / name
        d.mkdir()
        _write_rows(d / "metrics.jsonl", recs)
        plot_runs([str(d)])
        title, panels = boxes[-1]
        assert panels, name
        assert all(title.y0 >= p.y1 for p in panels), (name, title, [p.y1 for p in panels])


def test_eval_refuses_a_folder_without_a_model(tmp_path, capsys):
    bench = tmp_path / "b.jsonl"
    _write_rows(bench, [{"problem": "1=", "answer": "1"}])
    assert main(["eval", str(tmp_path), "--files", str(bench)]) == 2
    assert "neither an HF model folder nor a run directory" in capsys.readouterr().err


def test_plan_and_convert_are_wired(capsys):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = main(["plan", os.path.join(root, "configs", "mcpo_14b.yaml")])
    out = capsys.readouterr().out
    assert code in (0, 1) and "tp" in out.lower()
    with pytest.raises(SystemExit) as e:
        main(["convert", "--help"])
    assert e.value.code == 0
    assert "to-hf" in capsys.readouterr().out


def test_tool_command_calls_a_tool_as_a_rollout_does(tmp_path, capsys, monkeypatch):
    """`megatron-rlvr tool`: a program file runs in the sandbox and its stdout is the observation; the calculator is
    exact; a user tool gets its JSON arguments; a failing call prints its error and exits 1; bad input exits 2."""
    prog = tmp_path / "prog.py"
    prog.write_text("print(sum(range(10)))")
    assert main(["tool", "python", str(prog), "--wall-s", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "45\n" and "[tool python: status ok, " in captured.err
    assert main(["tool", "calculator", "2**70 // 3"]) == 0
    assert capsys.readouterr().out == f"{2**70 // 3}\n"
    prog.write_text("import time\ntime.sleep(10)")
    assert main(["tool", "python", str(prog), "--wall-s", "0.5"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "error: ran past wall_s=0.5 s: killed\n" and "status timeout" in captured.err
    (tmp_path / "cli_tool_mod.py").write_text("def greet(name: str) -> str:\n    return 'hello ' + name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["tool", "cli_tool_mod:greet", '{"name": "rl"}']) == 0
    assert capsys.readouterr().out == "hello rl\n"
    assert main(["tool", "cli_tool_mod:greet", "{bad"]) == 2
    assert "megatron-rlvr tool: error: tool cli_tool_mod:greet: the arguments are not valid JSON" in (
        capsys.readouterr().err
    )
    assert main(["tool", "shell", "ls"]) == 2
    assert "unknown tool 'shell'" in capsys.readouterr().err
