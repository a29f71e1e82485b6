"""``hidup train`` refuses, before any rank starts, what would fail or lose work later, and stops at a
non-finite loss without replacing the last good checkpoint (``hidup/runtime/train.py``,
``check_run_options`` and ``_check_finite``).

Each case asserts the one message, the exit status and, for the loss, that the checkpoint written
before the bad step is the one a resume finds.  The non-finite loss is deterministic: a model whose
loss is ``log(p)`` with ``p = 1`` takes one SGD step of 10 to ``p = -9``, so step 2's loss is NaN on
any machine.
"""

from __future__ import annotations

import textwrap

import pytest

from test_cli_errors import TINY, one_message, run_cli, run_main

LOG_OF_P = textwrap.dedent("""
    import torch


    class LogOfP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return torch.log(self.p).sum() + 0.0 * x.mean()


    def build(world_size=1, device=None):
        return LogOfP(), (torch.ones(4 * world_size, 2),)
""")


def test_keeping_no_checkpoint_is_refused(capsys):
    code, _, err = run_main(["train", *TINY, "--iterations", "1", "--keep-checkpoints", "0"], capsys)
    assert code == 1
    one_message(err, "hidup train: error: --keep-checkpoints 0: keep at least the last checkpoint (1)")


@pytest.mark.parametrize("lr", ["nan", "0", "-1", "inf"])
def test_a_learning_rate_that_is_not_a_positive_number_is_refused(lr, capsys):
    code, _, err = run_main(["train", *TINY, "--iterations", "1", "--lr", lr], capsys)
    assert code == 1
    one_message(err, f"hidup train: error: --lr {float(lr)}: the learning rate must be a positive number")


def test_checkpoint_dir_that_is_a_file_or_cannot_be_made(capsys, tmp_path):
    file = tmp_path / "file"
    file.write_text("not a folder")
    code, _, err = run_main(["train", *TINY, "--iterations", "1", "--checkpoint-dir", str(file)], capsys)
    assert code == 1
    one_message(err, f"--checkpoint-dir {file} is a file, not a folder")
    below = file / "ckpt"
    code, _, err = run_main(["train", *TINY, "--iterations", "1", "--checkpoint-dir", str(below)], capsys)
    assert code == 1
    one_message(err, f"--checkpoint-dir {below} cannot be written", "Fix: a folder this user can write")


def test_an_existing_checkpoint_is_continued_or_replaced_only_when_asked(capsys, tmp_path):
    ckpt = ["--checkpoint-dir", str(tmp_path)]
    assert run_main(["train", *TINY, "--iterations", "1", *ckpt], capsys)[0] == 0
    code, _, err = run_main(["train", *TINY, "--iterations", "2", *ckpt], capsys)
    assert code == 1
    one_message(err, "holds a checkpoint (checkpoint) that this run would replace", "--resume", "--overwrite")
    code, _, err = run_main(["train", *TINY, "--iterations", "1", *ckpt, "--resume", "--overwrite"], capsys)
    assert code == 1
    one_message(err, "--resume continues the checkpoint and --overwrite replaces it: give one")
    code, out, _ = run_main(["train", *TINY, "--iterations", "2", *ckpt, "--overwrite"], capsys)
    assert code == 0 and "running steps 1..2" in out
    code, out, _ = run_main(["train", *TINY, "--iterations", "2", *ckpt, "--resume"], capsys)
    assert code == 0 and "nothing left to run: the checkpoint is at step 2" in out
    code, _, err = run_main(["train", *TINY, "--iterations", "1", "--resume"], capsys)
    assert code == 1
    one_message(err, "--resume needs --checkpoint-dir")


def test_a_non_finite_loss_stops_training_and_keeps_the_last_good_checkpoint(tmp_path):
    (tmp_path / "log_of_p.py").write_text(LOG_OF_P)
    common = ["train", "--model", "log_of_p:build", "--optimizer", "sgd", "--lr", "10", "--checkpoint-dir", "ckpt"]
    out = run_cli([*common, "--iterations", "5", "--checkpoint-every", "1"], tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    one_message(out.stderr, "step 2: the loss is nan; training stops", "ckpt is kept as it was")
    assert "step     1  loss 0" in out.stdout and "step     2" not in out.stdout
    again = run_cli([*common, "--iterations", "1", "--resume"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing left to run: the checkpoint is at step 1 of --iterations 1" in again.stdout


def test_a_checkpoint_dir_in_use_by_another_job_is_refused(capsys, tmp_path):
    """A second job on a folder whose lock another process holds gets one message, before any rank starts."""
    from hidup.runtime import checkpoint

    with checkpoint.FolderLock(tmp_path):  # another open file description: flock conflicts in-process too
        code, _, err = run_main(["train", *TINY, "--iterations", "1", "--checkpoint-dir", str(tmp_path)], capsys)
    assert code == 1
    one_message(err, f"--checkpoint-dir {tmp_path} is in use by another training job (pid ", "Fix: wait for it")
    assert run_main(["train", *TINY, "--iterations", "1", "--checkpoint-dir", str(tmp_path)], capsys)[0] == 0


def test_the_lock_names_its_holder_and_ends_with_it(tmp_path):
    """The lock is the kernel's: held while its process runs (the message names it), gone when it ends."""
    import subprocess
    import sys

    from hidup.runtime import checkpoint

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from hidup.runtime import checkpoint; "
            f"checkpoint.FolderLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(checkpoint.CheckpointBusy, match=f"pid {holder.pid} on "):
            checkpoint.FolderLock(tmp_path).probe()
    finally:
        holder.kill()
        holder.wait()
    checkpoint.FolderLock(tmp_path).probe()  # killed outright: no stale lock


def _saved(tmp_path, steps: int = 1):
    import torch

    from hidup.runtime import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    path = tmp_path / f"step{steps}" / "checkpoint"
    checkpoint.save(path, model, opt, step=steps)
    return path, model, opt


def test_a_damaged_or_mixed_checkpoint_is_refused_with_one_message(tmp_path):
    """Every rank records the size and CRC-32 of the files it wrote, with the step: a flipped byte, a
    shard copied in from another step's checkpoint and a lost record are each named on load."""
    import shutil

    from hidup.runtime import checkpoint

    path, model, opt = _saved(tmp_path)
    assert checkpoint.load(path, model, opt)["step"] == 1  # intact: loads
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointDamaged, match=r"__0_0.distcp has \d+ bytes, CRC-32 .* damaged or from"):
        checkpoint.load(path, model, opt)

    other, _, _ = _saved(tmp_path, steps=2)  # the same model saved at another step
    shutil.copy(other / "__0_0.distcp", shard)  # a shard copied in (rank 0's holds the step: both checks see it)
    with pytest.raises(checkpoint.CheckpointDamaged, match="mixed from two checkpoints|from another checkpoint"):
        checkpoint.load(path, model, opt)
    path, model, opt = _saved(tmp_path)  # intact again
    shutil.copy(other / ".hidup-check.0.json", path / ".hidup-check.0.json")  # a record of another step
    with pytest.raises(checkpoint.CheckpointDamaged, match="from step 2, the checkpoint's step is 1"):
        checkpoint.load(path, model, opt)
    (path / ".hidup-check.0.json").unlink()
    (path / ".hidup-check.1.json").write_text("{}")  # another record still there: the checks are expected
    with pytest.raises(checkpoint.CheckpointDamaged, match="lacks .hidup-check.0.json"):
        checkpoint.load(path, model, opt)


def test_resuming_from_a_damaged_checkpoint_is_one_message(capsys, tmp_path):
    ckpt = ["--checkpoint-dir", str(tmp_path)]
    assert run_main(["train", *TINY, "--iterations", "1", *ckpt], capsys)[0] == 0
    shard = next((tmp_path / "checkpoint").glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    code, _, err = run_main(["train", *TINY, "--iterations", "2", *ckpt, "--resume"], capsys)
    assert code == 1
    one_message(err, "cannot resume: checkpoint", "damaged or from another checkpoint", "Fix: resume from an intact")
