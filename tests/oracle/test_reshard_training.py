"""A training checkpoint moves between layouts whole: optimizer state, fp8 scaling
state and the training state survive reshard chains bit for bit, and a run resumes
from the round trip exactly as from the original."""
import json

import numpy as np

from conftest import run
from test_train import COMMON, _tiny, datasets, latest, read_log, training_state


def groups(ck):
    m = json.loads((ck / "smp.json").read_text())
    return sorted({t["group"] for t in m["tensors"]})


def test_reshard_carries_the_whole_training_state(tmp_path):
    ck, data = _tiny(tmp_path)
    a = tmp_path / "a"
    a.mkdir()
    run("smp-train", "--ckpt", ck, "--data", data, "--save-dir", a, "--steps", 8, "--stop-at", 4, "--fp8", "delayed",
        "--log", a / "log.jsonl", *COMMON, check=0)
    src = latest(a)
    assert groups(src) == ["fp8", "optim/exp_avg", "optim/exp_avg_sq", "optim/master", "params"]
    # through two other layouts (ZeRO-1 shards of the optimizer state over dp*cp) and back
    run("smp-convert", "reshard", "--in", src, "--out", tmp_path / "x", "--layout", "pp=2,tp=2,dp=2", check=0)
    run("smp-verify", tmp_path / "x", check=0)
    m = json.loads((tmp_path / "x" / "smp.json").read_text())
    master = [t for t in m["tensors"] if t["group"] == "optim/master" and t["name"] == "model.embed_tokens.weight"][0]
    assert len(master["pieces"]) == 4  # tp=2 x dp=2 blocks
    run("smp-convert", "reshard", "--in", tmp_path / "x", "--out", tmp_path / "y", "--layout", "tp=4,cp=2", check=0)
    run("smp-convert", "reshard", "--in", tmp_path / "y", "--out", tmp_path / "back", "--layout", "pp=1", check=0)
    da, db = datasets(src), datasets(tmp_path / "back")
    assert da.keys() == db.keys()
    for k in da:
        assert np.array_equal(da[k], db[k]), k
    assert training_state(src) == training_state(tmp_path / "back")
    # resuming from the round trip continues exactly like resuming the original
    r1, r2 = tmp_path / "r1", tmp_path / "r2"
    run("smp-train", "--ckpt", src, "--data", data, "--save-dir", r1, "--log", r1 / "log.jsonl", check=0)
    run("smp-train", "--ckpt", tmp_path / "back", "--data", data, "--save-dir", r2, "--log", r2 / "log.jsonl", check=0)
    strip = lambda rows: [(r["step"], r["loss"], r["grad_norm"]) for r in rows]  # noqa: E731
    assert strip(read_log(r1 / "log.jsonl")) == strip(read_log(r2 / "log.jsonl"))
    assert len(read_log(r1 / "log.jsonl")) == 4
