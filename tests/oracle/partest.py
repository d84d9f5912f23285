"""What the parallel-training tests share: the data, the checkpoints, and single-rank
reference runs made on first use."""
import numpy as np
import pytest

import models
from conftest import run
from test_train import make_ckpt, read_log, write_tokens

SEQ = 16
COMMON = ["--batch", 8, "--seq", SEQ, "--lr", 3e-3, "--warmup", 2, "--seed", 3, "--clip", 0.5]


def make_setup(tmp, cases, common=COMMON, sharp=lambda case: False):
    """(tmp, checkpoints by case, train data, validation data, references): references
    [case, microbatches] is the single-rank run's log (validation batches are B/M
    sequences, so M matters to the validation loss), made when first asked for."""
    V = min(models.CASES[c][1]["vocab_size"] for c in cases)
    data = write_tokens(tmp / "d.bin", np.random.default_rng(7).integers(0, V, size=6000))
    val = write_tokens(tmp / "v.bin", np.random.default_rng(8).integers(0, V, size=2000))
    cks = {case: make_ckpt(tmp, case, sharp=sharp(case))[1] for case in cases}

    class Refs(dict):
        def __missing__(self, key):
            case, micro = key
            ref = tmp / f"ref-{case}-m{micro}"
            run("smp-train", "--ckpt", cks[case], "--data", data, "--save-dir", ref, "--steps", 6, "--val-data", val,
                "--val-every", 3, "--val-batches", 2, "--microbatches", micro, "--log", ref / "log.jsonl", *common,
                check=0)
            self[key] = read_log(ref / "log.jsonl")
            return self[key]
    return tmp, cks, data, val, Refs()


def setup_fixture(name, cases, sharp=lambda case: False):
    """A module's `setup` fixture: make_setup(...) with COMMON in a folder of its own (name)."""
    @pytest.fixture(scope="module")
    def setup(tmp_path_factory):
        return make_setup(tmp_path_factory.mktemp(name), cases, sharp=sharp)
    return setup
