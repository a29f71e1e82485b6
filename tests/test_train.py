"""End to end: `hidup train` / exp/train.py as a user runs it (subprocesses, gloo on CPU).

* save -> interrupt -> --resume continues the exact loss curve of an uninterrupted run;
* SIGTERM to the launcher makes every rank checkpoint at the same step and stop cleanly;
* SIGKILL to the launcher alone: its ranks save as on a preemption and exit, none keeps training;
* NODERANK/CPN: two "nodes" of two processes on one machine train like one node of four.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hidup.runtime import checkpoint

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "--model",
    "gpt",
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
    "--lr",
    "1e-2",
    "--warmup",
    "0",
]

DROPOUT = ["--model-arg", "dropout=0.2"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CPN", "NODERANK", "NNODES", "MASTER_PORT")
    }
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **{k: str(v) for k, v in extra.items()})
    return env


def _train(args: list[str], timeout: float = 240, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "exp" / "train.py"), *TINY, *args]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _losses(path: Path) -> list[float]:
    return json.loads(path.read_text())["losses"]


def test_resume_continues_the_same_loss_curve(tmp_path):
    """With dropout on: a resumed step draws the masks the uninterrupted run drew at that step."""
    full = tmp_path / "full.json"
    _train([*DROPOUT, "--world", "2", "--iterations", "6", "--json", str(full), "--master-port", str(_port())])
    ckpt = tmp_path / "ckpt"
    part = tmp_path / "part.json"
    _train(
        [
            *DROPOUT,
            "--world",
            "2",
            "--iterations",
            "6",
            "--checkpoint-dir",
            str(ckpt),
            "--stop-after",
            "3",
            "--json",
            str(part),
            "--master-port",
            str(_port()),
        ]
    )
    assert len(_losses(part)) == 3 and (ckpt / "checkpoint" / ".metadata").is_file()
    resumed = tmp_path / "resumed.json"
    _train(
        [
            *DROPOUT,
            "--world",
            "2",
            "--iterations",
            "6",
            "--checkpoint-dir",
            str(ckpt),
            "--resume",
            "--json",
            str(resumed),
            "--master-port",
            str(_port()),
        ]
    )
    a, b = _losses(full), _losses(resumed)
    assert len(a) == len(b) == 6
    assert a == pytest.approx(b, rel=1e-6), f"uninterrupted {a}\nresumed       {b}"


def test_sigterm_checkpoints_every_rank_and_stops(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = [
        sys.executable,
        str(ROOT / "exp" / "train.py"),
        *TINY,
        "--world",
        "2",
        "--iterations",
        "100000",
        "--checkpoint-dir",
        str(ckpt),
        "--master-port",
        str(_port()),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.time() + 180
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step") and int(line.split()[1]) >= 2:
                proc.send_signal(signal.SIGTERM)
                break
            assert time.time() < deadline, "training did not start in time:\n" + "".join(lines[-30:])
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, "".join(lines[-20:]) + rest[-3000:]
    assert f"after step {checkpoint.info(ckpt / 'checkpoint')['step']}: checkpoint saved in {ckpt}" in rest, rest
    state = checkpoint.info(ckpt / "checkpoint")
    assert 2 <= state["step"] < 1000
    assert len(state["loss_history"]) == state["step"]


def _children() -> dict[int, list[int]]:
    """pid -> the pids whose parent it is, from /proc."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] not in (b"Z", b"X"):
                out.setdefault(int(fields[1]), []).append(int(entry.name))
    return out


def _descendants(pid: int) -> set[int]:
    tree, seen, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs procfs to find the ranks")
def test_ranks_die_with_a_launcher_killed_outright(tmp_path):
    """SIGKILL to the launcher alone (it cannot forward it): its ranks, forked by the fork server,
    notice within a second, save as on a preemption and exit; nothing keeps training.  The launcher's
    temporary folder (the fork server's socket, the ranks' error files) outlives it, and the next
    launch removes it."""
    ckpt = tmp_path / "ckpt"
    temp = Path(tempfile.mkdtemp(prefix="hk"))  # short: the fork server's socket path must fit 107 bytes
    cmd = [sys.executable, str(ROOT / "exp" / "train.py"), *TINY, "--world", "2", "--iterations", "100000",
           "--checkpoint-dir", str(ckpt), "--master-port", str(_port())]  # fmt: skip
    env = _env(TMPDIR=temp)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, ranks = [], set()
    try:
        deadline = time.time() + 180
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step") and int(line.split()[1]) >= 2:
                ranks = _descendants(proc.pid)
                proc.kill()
                break
            assert time.time() < deadline, "training did not start in time:\n" + "".join(lines[-30:])
        proc.wait(timeout=30)
        assert ranks, "no rank process found under the launcher"
        deadline = time.time() + 60
        while _alive(ranks) and time.time() < deadline:
            time.sleep(0.5)
        left = _alive(ranks)
    finally:
        for pid in _alive(ranks):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the killed launcher still run: {sorted(left)}"
    state = checkpoint.info(ckpt / "checkpoint")  # the preemption checkpoint, complete
    assert 2 <= state["step"] < 100000 and len(state["loss_history"]) == state["step"]
    assert not [p.name for p in ckpt.iterdir() if p.name.endswith(".tmp")], list(ckpt.iterdir())
    left_behind = sorted(p.name for p in temp.iterdir())
    assert f"hidup-{proc.pid}" in left_behind, left_behind
    assert not [n for n in left_behind if n.startswith("pymp-")], left_behind  # all inside the launcher's folder
    make = "from hidup.runtime.launch import job_temp_dir; job_temp_dir()"  # what the next launch does first
    subprocess.run([sys.executable, "-c", make], cwd=ROOT, env=env, check=True, timeout=120)
    assert not list(temp.iterdir()), "the next launch left the dead launcher's folder, or its own"
    temp.rmdir()


def test_a_temporary_root_too_deep_for_the_fork_server_moves_the_job_folder_to_tmp(tmp_path):
    """A TMPDIR so deep that the fork server's socket (107 bytes at most) would not fit: the launcher's
    folder is made under /tmp instead, so the ranks still start (before: OSError, AF_UNIX path too long)."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    show = "from hidup.runtime.launch import job_temp_dir; print(job_temp_dir())"
    out = subprocess.run(
        [sys.executable, "-c", show], cwd=ROOT, env=_env(TMPDIR=deep), capture_output=True, text=True, timeout=120
    )
    folder = out.stdout.strip()
    assert out.returncode == 0 and folder.startswith("/tmp/hidup-"), out.stdout + out.stderr
    assert len(folder.encode()) + 32 <= 107 and not Path(folder).exists()  # removed when that process ended


def _alive(pids: set[int]) -> set[int]:
    tree = _children()
    running = {p for kids in tree.values() for p in kids}
    return {p for p in pids if p in running}


def test_noderank_cpn_two_nodes_match_one_node(tmp_path):
    one = tmp_path / "one.json"
    _train(["--iterations", "3", "--json", str(one)], CPN=4, NNODES=1, NODERANK=0, MASTER_PORT=_port())
    port = _port()
    two = tmp_path / "two.json"
    cmd = [sys.executable, str(ROOT / "exp" / "train.py"), *TINY, "--iterations", "3"]
    procs = [
        subprocess.Popen(
            cmd + (["--json", str(two)] if node == 0 else []),
            cwd=ROOT,
            env=_env(CPN=2, NNODES=2, NODERANK=node, MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node} failed:\n{out[-3000:]}"
    result = json.loads(two.read_text())
    assert result["world"] == 4
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-6)


def test_strategy_then_train_with_the_saved_plan(tmp_path):
    """The original workflow: exp/strategy.py saves a plan, exp/train.py --plan trains with it exactly as
    with the same plan searched on the spot; a plan for another model is refused with the fix."""
    plan = tmp_path / "plan.json"
    model_flags = TINY[: TINY.index("--lr")]
    search = subprocess.run(
        [
            sys.executable,
            str(ROOT / "exp" / "strategy.py"),
            *model_flags,
            "--world",
            "2",
            "--profile",
            "h200x4-socket",
            "--out",
            str(plan),
            "--quiet",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert search.returncode == 0, search.stdout + search.stderr
    saved, spot = tmp_path / "saved.json", tmp_path / "spot.json"
    _train(
        ["--world", "2", "--iterations", "3", "--plan", str(plan), "--json", str(saved), "--master-port", str(_port())]
    )
    _train(
        [
            "--world",
            "2",
            "--iterations",
            "3",
            "--profile",
            "h200x4-socket",
            "--json",
            str(spot),
            "--master-port",
            str(_port()),
        ]
    )
    assert _losses(saved) == pytest.approx(_losses(spot), rel=1e-6)
    # on a CPU --duplication auto keeps the plan's mode (the saved run); --duplication on / off overrides
    # it (the mode the plan does not choose); the two copies train the same model
    planned = json.loads(plan.read_text())["duplication"]
    saved_run = json.loads(saved.read_text())
    assert saved_run["duplication"] is planned
    flipped = tmp_path / "flipped.json"
    _train(
        [
            "--world",
            "2",
            "--iterations",
            "3",
            "--plan",
            str(plan),
            "--duplication",
            "off" if planned else "on",
            "--json",
            str(flipped),
            "--master-port",
            str(_port()),
        ]
    )
    flipped_run = json.loads(flipped.read_text())
    assert flipped_run["duplication"] is (not planned)
    assert flipped_run["losses"] == pytest.approx(saved_run["losses"], rel=1e-5)
    other = [
        sys.executable,
        str(ROOT / "exp" / "train.py"),
        *TINY,
        "--layers",
        "1",
        "--world",
        "2",
        "--iterations",
        "1",
        "--plan",
        str(plan),
        "--master-port",
        str(_port()),
    ]
    out = subprocess.run(other, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode != 0 and "run `hidup search` again" in out.stdout + out.stderr
