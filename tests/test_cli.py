"""The command line as a user types it: search -> show, a TOML config, verify, clear errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from hidup.cli import main

TINY = [
    "--layers",
    "2",
    "--d-model",
    "32",
    "--heads",
    "4",
    "--ffn",
    "64",
    "--seq-len",
    "8",
    "--batch-per-gpu",
    "2",
    "--vocab",
    "64",
]


def test_search_then_show(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "search",
                "--model",
                "bert-sgmoe",
                "--world",
                "4",
                *TINY,
                "--profile",
                "h200x4-socket",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    assert main(["show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "plan for bert-sgmoe on 4 ranks" in text and "trunk.layers.1" in text


def test_noise_changes_nothing_at_zero_and_is_reproducible(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        assert (
            main(
                [
                    "search",
                    "--model",
                    "gpt",
                    "--world",
                    "2",
                    *TINY,
                    "--noise",
                    "0.5",
                    "--seed",
                    "3",
                    "--out",
                    str(path),
                    "--quiet",
                ]
            )
            == 0
        )
    assert a.read_text() == b.read_text()


def test_toml_config_supplies_defaults_and_flags_win(tmp_path, capsys):
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        'model = "gpt"\nworld = 2\nlayers = 1\nd-model = 32\nheads = 4\nffn = 64\n'
        "seq-len = 8\nbatch-per-gpu = 2\nvocab = 64\n"
    )
    assert main(["describe", "--config", str(cfg), "--layers", "2", "--rows", "3"]) == 0
    assert "graph gpt for world size 2" in capsys.readouterr().out
    cfg.write_text('modle = "gpt"\n')
    with pytest.raises(SystemExit):
        main(["describe", "--config", str(cfg)])
    assert "unknown key 'modle'" in capsys.readouterr().err


def test_unknown_model_names_the_choices():
    with pytest.raises(SystemExit, match="choose one of: .*bert-sgmoe"):
        main(["describe", "--model", "bert-large"])


def test_verify_passes_and_exits_zero():
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hidup.cli",
            "verify",
            "--model",
            "bert-switch",
            "--world",
            "2",
            *TINY,
            "--style",
            "expert",
            "--steps",
            "2",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK: the plan matches the single-device model" in out.stdout


def test_verify_with_dropout_compares_the_same_masks():
    """GPT with dropout on every residual branch and inside attention, duplicated data parallelism, and
    two SGD steps that each draw their own step's masks on both sides."""
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "hidup", "verify", "--model", "gpt", "--world", "2", *TINY, "--model-arg",
           "dropout=0.3", "--style", "data", "--duplication", "on", "--steps", "2"]  # fmt: skip
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "duplication on" in out.stdout and "OK: the plan matches the single-device model" in out.stdout


def test_model_arg_reaches_zoo_overrides_without_flags(capsys):
    assert (
        main(
            [
                "describe",
                "--model",
                "gpt",
                "--world",
                "2",
                *TINY,
                "--model-arg",
                "dropout=0.0",
                "--model-arg",
                "aux_weight=0.5",
                "--rows",
                "1",
            ]
        )
        == 0
    )
    assert "graph gpt for world size 2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["describe", "--model", "gpt", "--world", "2", *TINY, "--model-arg", "dropot=0.1"])
    assert "unknown override(s) dropot" in str(e.value.code) and "dropout" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        main(["describe", "--model", "gpt", *TINY, "--model-arg", "layers=3"])
    assert "repeats --layers 2" in str(e.value.code)


def test_show_reads_the_plan_alone_without_loading_search_trace_or_runtime():
    """``hidup show`` prints from the plan file, so it imports none of the search, the front end, the code
    generator or the runtime's trainer (what makes it take a second and a half instead of five)."""
    plan = Path(__file__).resolve().parent.parent / "exp/records/moe/rank-plans-h200/mixtral-w4.json"
    code = (
        "import sys\nfrom hidup.cli import main\nmain(['show', sys.argv[1]])\n"
        "heavy = ('hidup.search', 'hidup.frontend', 'hidup.codegen', 'hidup.runtime.train', 'hidup.runtime.launch')\n"
        "print('LOADED', sorted(m for m in sys.modules if m.startswith(heavy)))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(plan)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "routed experts" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "LOADED []", out.stdout.splitlines()[-1]
