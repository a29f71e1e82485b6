"""The user's own model, ``--model package.module:function``, at every entry point.

A module written to a temporary directory (the current directory of each command, as for a user)
holds a tiny ``transformers`` Llama and a plain ``nn.Module`` factory.  Each goes search -> show ->
verify -> train with no model flags after the search (the plan records them); the plain one goes
through ``exp/strategy.py`` and ``exp/train.py`` and checks that ``verify`` keeps the plan's
duplication off.  Every bad input ends in one message and a non-zero exit, never a traceback.
Parity runs in float64, so ``verify``'s tolerance is not a matter of CPU kernels.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hidup.cli import main
from hidup.plan import Plan, PlanError

ROOT = Path(__file__).resolve().parent.parent
MODULE = "um_models"
PROFILE = ["--profile", "h200x4-socket"]

SOURCE = textwrap.dedent("""
    import torch
    import transformers


    class Step(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, labels):
            return self.model(input_ids=input_ids, labels=labels).loss


    def build_llama(layers=1, hidden=16, vocab=32, seq=8, batch=4, dtype="float32"):
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=2 * hidden, vocab_size=vocab,
                                       max_position_embeddings=seq)
        ids = torch.randint(0, vocab, (batch, seq))
        return Step(transformers.LlamaForCausalLM(cfg)).to(getattr(torch, dtype)), (ids, ids)


    class Regression(torch.nn.Module):
        def __init__(self, width, hidden):
            super().__init__()
            self.a = torch.nn.Linear(width, hidden)
            self.b = torch.nn.Linear(hidden, 1)

        def forward(self, x, y):
            return ((self.b(torch.relu(self.a(x))).squeeze(-1) - y) ** 2).sum()


    def build_mlp(world_size, width=8, hidden=16, batch_per_rank=4):
        n = batch_per_rank * world_size
        x, y = torch.randn(n, width, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
        return Regression(width, hidden).double(), {"x": x, "y": y}


    def build_raises(layers=1):
        raise ValueError("layers must be even")


    def build_wrong():
        return torch.nn.Linear(2, 2)


    def build_split_devices():
        with torch.device("meta"):
            model = Regression(8, 16)
        return model, (torch.randn(4, 8), torch.randn(4))
""")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("user")
    (d / f"{MODULE}.py").write_text(SOURCE)
    return d


@pytest.fixture
def here(workdir, monkeypatch) -> Path:
    """Run in the module's directory, as a user does."""
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    return workdir


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CPN", "NODERANK", "NNODES", "MASTER_PORT")
    }
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert out.returncode == 0, f"{' '.join(out.args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _refused(argv: list[str], capsys, *needles: str) -> str:
    """``hidup argv`` must end in one message (SystemExit, non-zero), no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    message = str(exit_info.value.code)
    assert exit_info.value.code not in (0, None) and "Traceback" not in message
    assert "Traceback" not in capsys.readouterr().err
    for needle in needles:
        assert needle in message, message
    return message


# ------------------------------------------------------------------------------ the whole path


def test_llama_factory_search_show_verify_train_without_model_flags(here, capsys, tmp_path):
    plan_path = here / "llama.json"
    assert (
        main(
            [
                "search",
                "--model",
                f"{MODULE}:build_llama",
                "--world",
                "2",
                "--model-arg",
                "dtype=float64",
                *PROFILE,
                "--out",
                str(plan_path),
                "--quiet",
            ]
        )
        == 0
    )
    saved = json.loads(plan_path.read_text())
    assert saved["model_source"] == {"model": f"{MODULE}:build_llama", "args": {"dtype": "float64"}}
    assert saved["world_size"] == 2
    plan = Plan.load(plan_path)
    capsys.readouterr()

    assert main(["show", str(plan_path)]) == 0
    shown = capsys.readouterr().out
    assert f"plan for {MODULE}:build_llama on 2 ranks" in shown and "layers.0" in shown

    assert main(["verify", "--plan", str(plan_path)]) == 0
    verified = capsys.readouterr().out
    assert "OK: the plan matches the single-device model" in verified
    assert f"duplication {'on' if plan.duplication else 'off'} (as the plan says)" in verified

    result = tmp_path / "train.json"
    _ok(
        _run(
            [
                sys.executable,
                "-m",
                "hidup.cli",
                "train",
                "--plan",
                str(plan_path),
                "--iterations",
                "2",
                "--warmup",
                "0",
                "--lr",
                "1e-2",
                "--json",
                str(result),
                "--master-port",
                str(_port()),
            ],
            here,
        )
    )
    trained = json.loads(result.read_text())
    assert trained["model"] == f"{MODULE}:build_llama" and trained["world"] == 2 and trained["steps"] == 2
    assert len(trained["losses"]) == 2 and all(math.isfinite(x) for x in trained["losses"])
    assert trained["duplication"] == plan.duplication


def test_plain_module_through_exp_scripts_and_verify_keeps_duplication_off(here, capsys, tmp_path):
    plan_path = here / "mlp.json"
    _ok(
        _run(
            [
                sys.executable,
                str(ROOT / "exp" / "strategy.py"),
                "--model",
                f"{MODULE}:build_mlp",
                "--world",
                "2",
                "--no-duplication",
                *PROFILE,
                "--out",
                str(plan_path),
                "--quiet",
            ],
            here,
        )
    )
    plan = Plan.load(plan_path)
    assert plan.model_source == {"model": f"{MODULE}:build_mlp", "args": {}} and not plan.duplication
    assert not plan.model_source["args"]

    assert main(["show", str(plan_path)]) == 0
    assert f"plan for {MODULE}:build_mlp on 2 ranks" in capsys.readouterr().out

    # `train` compiles the plan as it says (duplication off); verify must run that, not force two copies
    assert main(["verify", "--plan", str(plan_path), "--steps", "2"]) == 0
    verified = capsys.readouterr().out
    assert "duplication off (as the plan says)" in verified, verified
    assert "OK: the plan matches the single-device model" in verified

    result = tmp_path / "train.json"
    _ok(
        _run(
            [
                sys.executable,
                str(ROOT / "exp" / "train.py"),
                "--plan",
                str(plan_path),
                "--iterations",
                "2",
                "--warmup",
                "0",
                "--json",
                str(result),
                "--master-port",
                str(_port()),
            ],
            here,
        )
    )
    trained = json.loads(result.read_text())
    assert trained["model"] == f"{MODULE}:build_mlp" and trained["world"] == 2 and trained["duplication"] is False
    assert len(trained["losses"]) == 2 and all(math.isfinite(x) for x in trained["losses"])


# ------------------------------------------------------------------------------ records and flags


def _mlp_plan(here: Path, name: str = "mlp_small.json") -> Path:
    path = here / name
    if not path.exists():
        assert (
            main(
                [
                    "search",
                    "--model",
                    f"{MODULE}:build_mlp",
                    "--world",
                    "2",
                    "--model-arg",
                    "hidden=8",
                    *PROFILE,
                    "--out",
                    str(path),
                    "--quiet",
                ]
            )
            == 0
        )
    return path


def test_python_search_records_the_factory_or_show_says_what_to_pass(here, capsys):
    import hidup

    model, inputs = hidup.models.build(f"{MODULE}:build_mlp", world_size=2, hidden=8)
    assert isinstance(inputs, tuple) and len(inputs) == 2  # dict inputs, in forward's order
    graph = hidup.trace(model, inputs, world_size=2)
    recorded = hidup.search(graph, "h200x4-socket", model_source=(f"{MODULE}:build_mlp", {"hidden": 8}))
    recorded.save(here / "py.json")
    assert main(["show", str(here / "py.json")]) == 0
    assert f"plan for {MODULE}:build_mlp on 2 ranks" in capsys.readouterr().out

    bare = hidup.search(graph, "h200x4-socket")
    bare.save(here / "bare.json")
    assert main(["show", str(here / "bare.json")]) == 0  # the summary needs the plan alone
    bare_check = ["show", str(here / "bare.json"), "--check"]
    _refused(bare_check, capsys, "does not record its model", "--model", "model_source=")
    assert main([*bare_check, "--model", f"{MODULE}:build_mlp", "--model-arg", "hidden=8"]) == 0
    _refused(
        [*bare_check, "--model", f"{MODULE}:build_mlp"], capsys, "made for a different job"
    )  # the default hidden=16 is another model

    with pytest.raises(PlanError, match="only JSON values"):
        hidup.search(graph, "h200x4-socket", model_source=(f"{MODULE}:build_mlp", {"dtype": torch.float64}))


def test_flags_that_contradict_the_plan_are_refused(here, capsys):
    plan = str(_mlp_plan(here))
    _refused(["show", plan, "--model-arg", "hidden=4"], capsys, "hidden=4 (the plan has 8)")
    _refused(["show", plan, "--layers", "3"], capsys, "the plan records no layers")
    _refused(["show", plan, "--model", "gpt"], capsys, "--model gpt", "drop the model flags")
    assert main(["show", plan, "--model-arg", "hidden=8", "--world", "2"]) == 0  # agreeing flags are fine


def test_toml_model_table_names_the_factory_and_flags_win(here, capsys):
    cfg = here / "job.toml"
    cfg.write_text(f'world = 2\n[model]\nspec = "{MODULE}:build_mlp"\nhidden = 4\n')
    assert main(["describe", "--config", str(cfg), "--rows", "2"]) == 0
    assert f"graph {MODULE}:build_mlp for world size 2" in capsys.readouterr().out
    _refused(
        ["describe", "--config", str(cfg), "--model-arg", "depth=3"],
        capsys,
        "takes no argument depth",
        "width, hidden, batch_per_rank",
    )
    cfg.write_text(f'[model]\nspec = "{MODULE}:build_mlp"\nwhen = 1979-05-27\n')
    _refused(
        ["search", "--config", str(cfg), "--world", "2", "--out", str(here / "never.json")], capsys, "only JSON values"
    )
    assert not (here / "never.json").exists()


def test_a_version_1_plan_still_loads_and_shows_its_zoo_model(here, capsys):
    tiny = [
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--ffn",
        "32",
        "--seq-len",
        "4",
        "--batch-per-gpu",
        "2",
        "--vocab",
        "32",
    ]
    path = here / "gpt.json"
    assert main(["search", "--model", "gpt", "--world", "2", *tiny, *PROFILE, "--out", str(path), "--quiet"]) == 0
    old = json.loads(path.read_text())
    old["version"], old["model_config"] = 1, old.pop("model_source")["args"]
    path.write_text(json.dumps(old))
    capsys.readouterr()
    assert main(["show", str(path)]) == 0
    assert "plan for gpt on 2 ranks" in capsys.readouterr().out
    _refused(["show", str(path), "--layers", "2"], capsys, "layers=2 (the plan has 1)")


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("no_such_module_xyz:build", ["no module named 'no_such_module_xyz'", "PYTHONPATH"]),
        (f"{MODULE}:build_nothing", ["has no attribute 'build_nothing'", "build_llama"]),
        (f"{MODULE}:build_raises", ["the factory raised ValueError: layers must be even", f"{MODULE}.py:"]),
        (f"{MODULE}:build_wrong", ["must return (model, example_inputs)", "Linear"]),
        (
            f"{MODULE}:build_split_devices",
            [
                "on different devices",
                "model tensor 'a.weight' is on meta",
                "input 'x' is on cpu",
                "create the example inputs on the model's device",
            ],
        ),
    ],
)
def test_a_bad_factory_is_one_message(here, capsys, spec, needles):
    _refused(["search", "--model", spec, "--world", "2", "--out", str(here / "never.json")], capsys, *needles)


def test_a_plan_for_another_world_or_model_is_refused_before_ranks_start(here, capsys, monkeypatch):
    import hidup.runtime.train
    import hidup.runtime.verify

    def spawned(*args, **kwargs):
        raise AssertionError("ranks were started for a plan that cannot run")

    monkeypatch.setattr(hidup.runtime.train, "launch", spawned)
    monkeypatch.setattr(hidup.runtime.verify, "launch", spawned)
    plan = str(_mlp_plan(here))
    _refused(["train", "--plan", plan, "--world", "4"], capsys, "searched for 2 ranks, not --world 4")
    _refused(["verify", "--plan", plan, "--world", "4"], capsys, "searched for 2 ranks, not --world 4")
    _refused(["train", "--plan", plan, "--cpn", "3"], capsys, "this launch has 3")
    _refused(["train", "--plan", plan, "--model", f"{MODULE}:build_llama"], capsys, f"searched for {MODULE}:build_mlp")


def test_bad_input_on_the_real_command_line_has_no_traceback(here):
    """The same messages through the console entry point: stderr, exit status 1, no traceback."""
    out = _run([sys.executable, "-m", "hidup", "search", "--model", f"{MODULE}:build_raises", "--world", "2"], here)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "the factory raised ValueError: layers must be even" in out.stderr
    plan = str(_mlp_plan(here, "mlp_cli.json"))
    out = _run([sys.executable, str(ROOT / "exp" / "train.py"), "--plan", plan, "--world", "4"], here)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "searched for 2 ranks, not --world 4" in out.stderr


def _rank_fails_with_a_user_error(ctx):
    from hidup.models.source import ModelSourceError

    raise ModelSourceError(f"rank {ctx.rank}: the model cannot be built")


def test_a_user_error_inside_the_ranks_comes_back_as_its_message():
    from hidup.runtime.launch import LaunchError, launch

    env = {"CPN": "2", "NNODES": "1", "NODERANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port())}
    with pytest.raises(LaunchError) as failure:
        launch(_rank_fails_with_a_user_error, env=env, backend="gloo", timeout_s=60)
    assert str(failure.value) in ("rank 0: the model cannot be built", "rank 1: the model cannot be built")


def test_profile_ops_model_accepts_factories(here):
    from hidup.cli.profile_flags import _names

    assert _names(f"gpt,{MODULE}:build_mlp", "--ops-model") == ["gpt", f"{MODULE}:build_mlp"]
    with pytest.raises(SystemExit, match="has no attribute 'nope'"):
        _names(f"{MODULE}:nope", "--ops-model")
