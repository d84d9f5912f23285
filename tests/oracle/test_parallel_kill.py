"""Killing one rank of a parallel run (kill -9, no chance to clean up): every rank
ends within a bound, the last whole checkpoint verifies, and the run resumes from it."""
import os
import signal
import subprocess
import time

import numpy as np

from conftest import BUILD, run
from test_train import make_ckpt, read_log, vocab_of, write_tokens

CASE = "llama-gqa-f32"
BOUND_S = 60


def test_kill_one_rank_mid_run(tmp_path):
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(3).integers(0, vocab_of(CASE), size=20000))
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "4", str(BUILD / "bin" / "smp-train"),
           "--ckpt", str(ck), "--data", str(data), "--save-dir", str(out), "--layout", "pp=2,tp=2",
           "--steps", "100000", "--save-every", "2", "--batch", "8", "--seq", "16", "--microbatches", "2",
           "--lr", "1e-3", "--log", str(out / "log.jsonl")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        # wait for two checkpoints, so that the kill lands in the middle of the run
        t0 = time.time()
        while not (out / "step-000004").exists():
            assert p.poll() is None, p.communicate()
            assert time.time() - t0 < 240, "no checkpoint appeared"
            time.sleep(0.2)
        ranks = subprocess.run(["pgrep", "-f", f"smp-train.*{out}"], capture_output=True, text=True).stdout.split()
        ranks = [int(r) for r in ranks if int(r) != p.pid]
        assert len(ranks) == 4, ranks
        os.kill(sorted(ranks)[2], signal.SIGKILL)
        killed_at = time.time()
        p.communicate(timeout=BOUND_S)
        assert p.returncode != 0
        assert time.time() - killed_at < BOUND_S
        # nothing of the run is left running
        time.sleep(1)
        left = subprocess.run(["pgrep", "-f", f"smp-train.*{out}"], capture_output=True, text=True).stdout.split()
        assert not left, left
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    latest = (out / "latest").read_text().strip()
    assert latest.startswith("step-") and int(latest[5:]) >= 4
    run("smp-verify", out / latest, check=0)
    # every folder that looks whole (has smp.json) verifies; the rest are hidden staging folders
    for d in out.iterdir():
        if d.is_dir() and (d / "smp.json").exists():
            run("smp-verify", d, check=0)
        elif d.is_dir():
            assert d.name.startswith(".tmp-"), d
    # the run resumes from its last whole checkpoint (here on one rank)
    step = int(latest[5:])
    run("smp-train", "--ckpt", out, "--data", data, "--save-dir", tmp_path / "resumed", "--steps", step + 2,
        "--log", tmp_path / "resumed.jsonl", check=0)
    rows = read_log(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in rows] == [step + 1, step + 2]
