"""The issue's own example: a run saved at pp=2,tp=2,dp=2 resumes at tp=4,cp=2 (8
ranks each), optimizer state included, and tracks the straight single-rank run."""
import re
import shutil

import numpy as np

from conftest import run
from test_parallel import assert_tracks, mpirun
from test_parallel_tp import CASES as _TP_CASES  # noqa: F401  (registers llama-tp-kv2)
from test_train import make_ckpt, read_log, write_tokens

CASE = "llama-tp-kv2"  # 8 heads, 2 kv heads: tp=4 replicates each kv head twice
COMMON = ["--batch", 8, "--seq", 16, "--lr", 3e-3, "--warmup", 2, "--seed", 3, "--clip", 0.5, "--microbatches", 1]


def test_resume_pp2_tp2_dp2_at_tp4_cp2(tmp_path):
    _, ck = make_ckpt(tmp_path, CASE, sharp=False)
    data = write_tokens(tmp_path / "d.bin", np.random.default_rng(7).integers(0, 103, size=6000))
    ref = tmp_path / "ref"
    run("smp-train", "--ckpt", ck, "--data", data, "--save-dir", ref, "--steps", 6, "--log", ref / "log.jsonl",
        *COMMON, check=0)
    a = tmp_path / "a"
    mpirun(8, "--ckpt", ck, "--data", data, "--save-dir", a, "--steps", 6, "--stop-at", 3, "--layout", "pp=2,tp=2,dp=2",
           "--log", a / "log.jsonl", *COMMON)
    assert (a / "latest").read_text().strip() == "step-000003"
    b = tmp_path / "b"
    shutil.copytree(a, b, symlinks=True)
    alone = mpirun(8, "--ckpt", a, "--data", data, "--save-dir", a, "--layout", "tp=4,cp=2", "--log", a / "log.jsonl")
    rows = read_log(a / "log.jsonl")
    assert_tracks(rows, read_log(ref / "log.jsonl"), 5e-4, "pp=2,tp=2,dp=2 then tp=4,cp=2")
    run("smp-verify", a / "step-000006", check=0)
    # the ranks reading together (each chunk once, an all-to-all) load the same bits:
    # parameters, fp32 master and both moments, so the resumed steps are identical
    together = mpirun(8, "--ckpt", b, "--data", data, "--save-dir", b, "--layout", "tp=4,cp=2", "--log",
                      b / "log.jsonl", "--read-together", "yes")
    strip = lambda rows: [(r["step"], r["loss"], r["grad_norm"]) for r in rows]  # noqa: E731
    assert strip(read_log(b / "log.jsonl")) == strip(rows)
    # ...through the together path: the cp=2 replicas each read their chunks when alone
    read = [int(re.search(r"loaded .*: (\d+) bytes", p.stderr).group(1)) for p in (alone, together)]
    assert read[1] < 0.75 * read[0], read
    # and the load line says what went between the ranks (nothing when each read alone)
    assert re.search(r"smp-train: loaded .*, [1-9]\d* bytes between the ranks$", together.stderr, re.M), together.stderr
    assert "between the ranks" not in alone.stderr, alone.stderr
