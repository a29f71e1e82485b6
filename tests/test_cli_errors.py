"""Bad inputs at the command line: each ends in one message and a non-zero exit, never a traceback.

A held-out list, one case per promise of the command line: plan, profile, search, launch, path and
checkpoint errors (in this process and inside spawned ranks), a plan for another world size or
model refused before any rank starts, a rank that dies named with its signal, ``--out`` refused
before the search, the ILP's time limit (a plan marked unproven, or no plan), the status lines of
the phases that take time, and ``--debug`` showing the traceback.  Commands run through
``hidup.cli.main`` in this process where no rank is spawned, else as a user runs them, in a
subprocess.  The smallest zoo configurations on world 2 keep the file quick.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hidup.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "--model",
    "gpt",
    "--layers",
    "1",
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


def run_main(argv, capsys) -> tuple[int, str, str]:
    """``hidup ARGV`` in this process: (exit status, stdout, stderr).  A traceback would escape as
    an exception and fail the test."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
        if isinstance(code, str):  # the message argparse / main exit with goes to stderr
            print(code, file=sys.stderr)
            code = 1
    out, err = capsys.readouterr()
    return code or 0, out, err


def run_cli(argv, cwd: Path, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``hidup ARGV`` as a user types it."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full.pop("HIDUP_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "hidup", *argv], cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout
    )


def one_message(err: str, *needles: str) -> None:
    assert "Traceback" not in err, err[-3000:]
    for needle in needles:
        assert needle in err, err[-3000:]


@pytest.fixture(scope="module")
def plan2(tmp_path_factory) -> Path:
    """A plan for the tiny GPT on 2 ranks."""
    path = tmp_path_factory.mktemp("plans") / "gpt2.json"
    assert main(["search", *TINY, "--world", "2", "--out", str(path), "--quiet"]) == 0
    return path


# ------------------------------------------------------------------------------------- plan errors
@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "no plan file at"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a JSON list, not a hidup plan"),
    ],
)
def test_unreadable_plan(tmp_path, capsys, content, needle):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    code, _, err = run_main(["show", str(path)], capsys)
    assert code == 1
    one_message(err, "hidup show: error:", needle)


def test_plan_for_another_world_size_is_refused_before_ranks_start(plan2, capsys):
    code, _, err = run_main(["verify", "--plan", str(plan2), "--world", "4"], capsys)
    assert code == 1
    one_message(err, "searched for 2 ranks, not --world 4")
    assert "starting" not in err  # no rank was spawned


def test_plan_for_another_launch_size_is_refused_before_ranks_start(plan2, capsys, monkeypatch):
    monkeypatch.setenv("CPN", "3")
    code, _, err = run_main(["train", "--plan", str(plan2), "--iterations", "1"], capsys)
    assert code == 1
    one_message(err, "searched for 2 ranks but this launch has 3")
    assert "starting" not in err


def test_plan_for_another_model_is_refused_before_ranks_start(plan2, tmp_path, capsys):
    data = json.loads(plan2.read_text())
    data["model_source"]["args"]["layers"] = 2  # the record now names a model the choices do not fit
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    code, _, err = run_main(["verify", "--plan", str(other)], capsys)
    assert code == 1
    one_message(err, "made for a different job", "graph fingerprint")
    assert "starting" not in err


def test_model_flags_that_contradict_the_plan(plan2, capsys):
    code, _, err = run_main(["train", "--plan", str(plan2), "--layers", "3"], capsys)
    assert code == 1
    one_message(err, "contradict it")


# ---------------------------------------------------------------------------------- profile errors
def test_unknown_profile(capsys, tmp_path):
    code, _, err = run_main(
        ["search", *TINY, "--world", "2", "--profile", "no-such-profile", "--out", str(tmp_path / "p.json")], capsys
    )
    assert code == 1
    one_message(err, "no profile 'no-such-profile'", "h200x4-nvlink")


def test_malformed_profile(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "flops": "fast"}))
    code, _, err = run_main(
        ["search", *TINY, "--world", "2", "--profile", str(bad), "--out", str(tmp_path / "p.json")], capsys
    )
    assert code == 1
    one_message(err, "hidup search: error:", str(bad))


# ----------------------------------------------------------------------------------- search errors
def test_memory_budget_no_plan_fits(capsys, tmp_path):
    code, _, err = run_main(
        ["search", *TINY, "--world", "2", "--memory", "1e-6", "--out", str(tmp_path / "p.json")], capsys
    )
    assert code == 1
    one_message(err, "memory budget")
    assert not (tmp_path / "p.json").exists()


def test_unknown_model_and_bad_flag_values(capsys):
    code, _, err = run_main(["describe", "--model", "bert-large"], capsys)
    assert code == 1
    one_message(err, "choose one of")
    code, _, err = run_main(["search", *TINY, "--algorithm", "simplex"], capsys)
    assert code == 2  # argparse: a malformed command line
    one_message(err, "invalid choice")
    code, _, err = run_main(["search", *TINY, "--time-limit", "0"], capsys)
    assert code == 1
    one_message(err, "--time-limit 0: give a positive number of seconds")
    for command in ("train", "verify"):
        code, _, err = run_main([command, *TINY, "--dist-timeout", "0"], capsys)
        assert code == 2  # argparse: a malformed command line
        one_message(err, "--dist-timeout: '0': give a positive number of seconds")


def test_unknown_model_inside_the_ranks_is_one_message(tmp_path):
    """``verify`` builds its model in the ranks: an unknown zoo name is still one message."""
    out = run_cli(["verify", "--model", "nosuch", "--world", "2"], tmp_path)
    assert out.returncode == 1
    one_message(out.stderr, "hidup verify: error: unknown model 'nosuch'; the zoo has:")


# ------------------------------------------------------------------------------------ --out errors
@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_out_that_cannot_be_written_fails_before_the_search(capsys, tmp_path, kind):
    out = tmp_path / "no" / "such" / "plan.json" if kind == "missing" else tmp_path
    code, _, err = run_main(["search", *TINY, "--world", "2", "--out", str(out)], capsys)
    assert code == 1
    one_message(err, "does not exist" if kind == "missing" else "is a directory")
    assert "tracing" not in err  # refused before any work


# ----------------------------------------------------------------------- launch and checkpoint errors
def test_launch_settings(capsys, monkeypatch):
    monkeypatch.setenv("CPN", "two")
    code, _, err = run_main(["train", *TINY, "--iterations", "1"], capsys)
    assert code == 1
    one_message(err, "CPN='two' is not an integer")


def test_corrupt_checkpoint_in_process(capsys, tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    code, _, err = run_main(
        ["train", *TINY, "--iterations", "2", "--checkpoint-dir", str(tmp_path), "--resume"], capsys
    )
    assert code == 1
    one_message(err, "cannot resume from checkpoint", "checkpoint.pt", "not a checkpoint torch.load can read")


def test_compile_error_during_a_run(capsys, monkeypatch):
    import hidup.codegen
    from hidup.codegen.program import CompileError

    def refuse(*args, **kwargs):
        raise CompileError("plan chooses a signature this model does not have. Fix: search again")

    monkeypatch.setattr(hidup.codegen, "compile", refuse)
    code, _, err = run_main(["train", *TINY, "--iterations", "1"], capsys)
    assert code == 1
    one_message(err, "hidup train: error: plan chooses a signature")


def test_train_header_and_nothing_left_to_run(capsys, tmp_path):
    code, out, _ = run_main(["train", *TINY, "--iterations", "1", "--checkpoint-dir", str(tmp_path)], capsys)
    assert code == 0
    assert "train gpt: world 1 (gloo), plan searched now, duplication" in out and "steps eager" in out
    assert "running steps 1..1; the first includes warm-up" in out
    code, out, _ = run_main(
        ["train", *TINY, "--iterations", "1", "--checkpoint-dir", str(tmp_path), "--resume"], capsys
    )
    assert code == 0
    assert "nothing left to run: the checkpoint is at step 1 of --iterations 1" in out


def test_corrupt_checkpoint_inside_ranks(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "checkpoint.pt").write_bytes(b"not a checkpoint")
    out = run_cli(
        ["train", *TINY, "--world", "2", "--iterations", "2", "--checkpoint-dir", str(ckpt), "--resume"], tmp_path
    )
    assert out.returncode == 1, out.stderr[-3000:]
    one_message(out.stderr, "hidup train: error: cannot resume from checkpoint", "starting 2 ranks")
    assert out.stderr.count("cannot resume") == 1, out.stderr  # one message, not one per rank


DEAD_RANK = textwrap.dedent("""
    import os
    import signal

    import torch
    import torch.distributed as dist


    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.b = torch.nn.Linear(16, 1)

        def forward(self, x, y):
            return ((self.b(torch.relu(self.a(x))) - y) ** 2).mean()


    def build(world_size=2):
        if dist.is_initialized() and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # rank 1 dies; rank 0 goes on to its first collective
        return Regression(), (torch.randn(4 * world_size, 8), torch.randn(4 * world_size, 1))
""")


def test_a_rank_that_dies_is_named_with_its_signal(tmp_path):
    (tmp_path / "dies_on_rank1.py").write_text(DEAD_RANK)
    out = run_cli(["verify", "--model", "dies_on_rank1:build", "--world", "2", "--dist-timeout", "60"], tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    one_message(out.stderr, "rank 1 (node 0, local rank 1", "died from signal SIGKILL", "verify: building")
    assert "onnection reset" not in out.stderr and "Connection closed" not in out.stderr, out.stderr[-3000:]


HUNG_RANK = DEAD_RANK.replace(
    "os.kill(os.getpid(), signal.SIGKILL)  # rank 1 dies; rank 0 goes on to its first collective",
    "time.sleep(600)  # rank 1 hangs; rank 0 times out in its first collective",
).replace("import os", "import os\nimport time")


def test_a_rank_that_hangs_is_named_as_hung(tmp_path):
    """Rank 1 never reaches the collective rank 0 waits in: the report names rank 1 as hung (with its
    stacks), not rank 0's timeout traceback, and no temporary file of the failed rank is left."""
    (tmp_path / "hangs_on_rank1.py").write_text(HUNG_RANK)
    scratch = tmp_path / "tmp"  # the job's temporary files: rank 0's failure writes torch's error file
    scratch.mkdir()
    out = run_cli(
        ["verify", "--model", "hangs_on_rank1:build", "--world", "2", "--dist-timeout", "5"],
        tmp_path,
        env={"TMPDIR": str(scratch)},
    )
    assert not list(scratch.glob("pytorch-errorfile-*")), "a failed rank's error file was left behind"
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    one_message(out.stderr, "rank 1 (node 0, local rank 1", "hung: it neither finished nor failed", "timed out")
    stacks = out.stderr.split("hung: Python stacks of local rank 1", 1)[-1]
    assert 'hangs_on_rank1.py", line' in stacks, out.stderr[-3000:]  # where it was stuck


# --------------------------------------------------------------------------------- ILP time limit
def test_a_missing_cbc_library_is_one_message(capsys, tmp_path, monkeypatch):
    """python-mip without its CBC library fails late with a NameError; the ILP says how to get CBC,
    and the DP's no-plan message still states the budget (the least memory needs CBC)."""
    import mip

    def no_cbc(*args, **kwargs):
        raise NameError("name 'cbclib' is not defined")

    monkeypatch.setattr(mip, "Model", no_cbc)
    code, _, err = run_main(
        ["search", *TINY, "--world", "2", "--algorithm", "ilp", "--out", str(tmp_path / "p.json")], capsys
    )
    assert code == 1
    one_message(err, "the ILP needs the CBC solver", "pip install cbcbox", "PMIP_CBC_LIBRARY", "'dp'")
    code, _, err = run_main(
        ["search", *TINY, "--world", "2", "--memory", "1e-6", "--out", str(tmp_path / "p.json")], capsys
    )
    assert code == 1
    one_message(err, "memory budget of 1000 bytes", "whether any plan fits is unknown", "pip install cbcbox")
    assert not (tmp_path / "p.json").exists()


def test_ilp_time_limit_returns_an_unproven_plan_and_records_it(capsys, tmp_path):
    """A limit of 1 ns is spent before CBC can run: the DP's seed is the plan, marked unproven."""
    out = tmp_path / "ilp.json"
    code, stdout, err = run_main(
        ["search", *TINY, "--world", "2", "--algorithm", "ilp", "--time-limit", "1e-9", "--out", str(out)], capsys
    )
    assert code == 0
    one_message(err, "warning: ILP: stopped by the time limit of 1e-09 s", "optimality is unproven")
    solver = json.loads(out.read_text())["options"]["solver"]
    assert solver["status"] == "feasible" and solver["proven_optimal"] is False and solver["time_limit_s"] == 1e-9
    assert "next:" in stdout and f"hidup verify --plan {out}" in stdout


def test_ilp_time_limit_without_any_plan(capsys, tmp_path):
    """No seed fits a budget below every plan's memory, and 1 ns leaves CBC no time: no plan."""
    code, _, err = run_main(
        [
            "search",
            *TINY,
            "--world",
            "2",
            "--algorithm",
            "ilp",
            "--time-limit",
            "1e-9",
            "--memory",
            "1e-6",
            "--out",
            str(tmp_path / "p.json"),
        ],
        capsys,
    )
    assert code == 1
    one_message(err, "the ILP found no plan within its time limit of 1e-09 s", "--time-limit")
    assert not (tmp_path / "p.json").exists()


# ---------------------------------------------------------------------- status lines and --debug
def test_status_lines_next_steps_profiles_and_version(capsys, tmp_path, plan2):
    code, out, err = run_main(["search", *TINY, "--world", "2", "--out", str(tmp_path / "p.json")], capsys)
    assert code == 0 and "tracing gpt for 2 ranks" in err and "next:" in out
    code, out, err = run_main(["show", str(plan2)], capsys)
    assert code == 0 and "tracing" not in err and "how the ops run" in out  # the plan alone
    code, out, err = run_main(["show", str(plan2), "--check"], capsys)
    assert code == 0 and "rebuilding the plan's model: tracing gpt" in err
    code, out, _ = run_main(["profiles"], capsys)
    assert code == 0 and "paper-v100-9.7gbps (default)" in out and "h200x4-nvlink" in out
    code, out, _ = run_main(["--version"], capsys)
    assert code == 0 and out.startswith("hidup ")


def test_debug_shows_the_traceback(tmp_path, capsys):
    from hidup.plan import PlanError

    with pytest.raises(PlanError):
        main(["show", str(tmp_path / "missing.json"), "--debug"])
    with pytest.raises(PlanError):
        main(["--debug", "show", str(tmp_path / "missing.json")])
    assert "HIDUP_DEBUG" not in os.environ


# ------------------------------------------------------------------- the ILP's outcomes in Python
def _small_problem():
    import hidup.profiler
    from hidup.search.problem import Problem
    from hidup.search.synthetic import random_graph

    return Problem(random_graph(201, calls=8, max_sigs=4), hidup.profiler.load("h200x4-socket"))


def test_ilp_outcomes_under_a_tiny_limit_and_without_one():
    from hidup.search import dp, ilp
    from hidup.search.problem import SearchError
    from hidup.search.schedule import evaluate

    pr = _small_problem()
    seed, seed_time = dp.solve(pr, False)
    unproven = ilp.optimize(pr, time_limit=1e-9, start=seed)  # the limit is spent before CBC starts
    assert unproven.status == "feasible" and not unproven.proven and unproven.ks == seed
    assert unproven.bound is None and unproven.gap is None and "unproven" in unproven.describe()
    with pytest.raises(SearchError, match="no plan within its time limit"):
        ilp.optimize(pr, time_limit=1e-9)
    proven = ilp.optimize(pr, time_limit=None)
    assert proven.status == "optimal" and proven.info()["proven_optimal"] is True
    assert proven.objective == pytest.approx(evaluate(pr, proven.ks, False).objective, rel=1e-7)
    assert proven.bound <= proven.objective * (1 + 1e-7) and proven.objective <= seed_time * (1 + 1e-7)


def test_search_api_warns_and_records_an_unproven_plan():
    import hidup
    from hidup.search.synthetic import random_graph

    graph = random_graph(202, calls=6, max_sigs=3)
    with pytest.warns(UserWarning, match="optimality is unproven"):
        plan = hidup.search(graph, "h200x4-socket", algorithm="ilp", time_limit=1e-9)
    assert plan.options["solver"]["status"] == "feasible" and plan.options["solver"]["proven_optimal"] is False


def test_cbc_log_lines_give_the_incumbent_and_bound():
    from hidup.search.ilp import _Monitor

    mon = _Monitor(model=None, say=print, label="ilp", t0=0.0)
    mon.parse("Cbc0010I After 100 nodes, 12 on tree, 83755.6 best solution, best possible 83371.8 (2.37 seconds)")
    assert (mon.nodes, mon.incumbent, mon.bound) == (100, 83755.6, 83371.8)
    mon = _Monitor(model=None, say=print, label="ilp", t0=0.0)
    for line in [
        "     Nodes   OnTree  Depth         BestSol Method                 BestBound     Gap%   Time(s)",
        "  \u2500\u2500\u2500\u2500\u2500\u2500 \u2500\u2500\u2500\u2500",
        " \u2605       0        1      0         83755.6 Previous solutio           83755    0.00%      2.72",
        "        34        4      7         83755.6                            83755.2    0.00%      3.83",
        "\u25b6 Cut generation (root node, part 2)",
        "     1      532        0      3        0.3          83371.8     2.79",
    ]:  # not a search row
        mon.parse(line)
    assert (mon.nodes, mon.incumbent, mon.bound) == (34, 83755.6, 83755.2)


def test_plan_with_an_invalid_form_is_one_message(plan2, tmp_path, capsys):
    data = json.loads(plan2.read_text())
    name = next(n for n, c in data["choices"].items() if c["outputs"])
    data["choices"][name]["outputs"][0] = "gather_x"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    code, _, err = run_main(["show", str(bad)], capsys)
    assert code == 1
    one_message(err, f"hidup show: error: {bad}:", "the file is not a valid hidup plan")


def test_a_zoo_model_in_float64_trains_as_it_searches(capsys, tmp_path):
    """``--model-arg dtype=float64`` on a zoo model: the search builds it in float64, and so do the
    ranks (the dtype is build's argument beside the zoo's overrides, not an override)."""
    plan = tmp_path / "plan.json"
    args = [*TINY, "--model-arg", "dtype=float64"]
    assert run_main(["search", *args, "--world", "2", "--quiet", "--out", str(plan)], capsys)[0] == 0
    code, out, err = run_main(["train", "--plan", str(plan), "--iterations", "1", "--world", "2"], capsys)
    assert code == 0, err
