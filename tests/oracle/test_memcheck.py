"""Every command line's ordinary path under valgrind's memcheck (the release build).

ASan and UBSan (build/asan, the other suites) do not see reads of uninitialized memory;
memcheck does. smp-convert read options past those it had parsed from an uninitialized
array: the flags' values were stack garbage, which crashed hf2smp on one machine and
passed on every other. Each case here runs one command of the CLIs on a tiny model
(hf2smp, reshard, init, merge, verify, inspect, eval, two training steps and a resume)
and fails on any memcheck error (uninitialized values, invalid reads or writes, bad
frees; leaks are not checked here: ASan's LeakSanitizer does that) as well as on a
failed command. Skipped, saying so, where valgrind is not installed.
"""
import json
import shutil
import subprocess

import pytest

import models
from conftest import BUILD
from test_train import write_tokens

pytestmark = pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
MODEL = "llama-gqa-f32"
VOCAB = models.CASES[MODEL][1]["vocab_size"]


def memcheck(cmd, *args):
    p = subprocess.run(["valgrind", "-q", "--error-exitcode=99", "--track-origins=yes", "--trace-children=yes",
                        str(BUILD / "bin" / cmd), *map(str, args)],
                       capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, f"{cmd} {args}: exit {p.returncode}\n{p.stderr[-4000:]}"
    assert "==" not in p.stderr, p.stderr[-4000:]  # a report whose error memcheck did not count
    return p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("memcheck")
    models.make(MODEL, d / "hf")
    write_tokens(d / "tok.bin", [(7 * i) % VOCAB for i in range(2 * 2 * 16 + 1)])
    return d


def test_convert_reshard_merge_verify_inspect(tiny):
    memcheck("smp-convert", "hf2smp", "--in", tiny / "hf", "--out", tiny / "ck", "--layout", "pp=2,tp=2",
             "--no-fsync")
    memcheck("smp-convert", "reshard", "--in", tiny / "ck", "--out", tiny / "ck2", "--layout", "tp=1",
             "--compress", "none", "--threads", 2)
    memcheck("smp-merge", "--in", tiny / "ck2", "--out", tiny / "merged", "--no-fsync")
    memcheck("smp-verify", tiny / "ck")
    assert json.loads(memcheck("smp-inspect", tiny / "ck", "--json").stdout)


def test_init(tiny):
    memcheck("smp-convert", "init", "--config", tiny / "hf" / "config.json", "--out", tiny / "init",
             "--layout", "tp=2", "--seed", 3)


def test_eval_train_resume(tiny):
    if not (tiny / "ck").exists():
        memcheck("smp-convert", "hf2smp", "--in", tiny / "hf", "--out", tiny / "ck", "--layout", "pp=2,tp=2")
    memcheck("smp-eval", "--ckpt", tiny / "ck", "--data", tiny / "tok.bin", "--batch", 2, "--seq", 16, "--json")
    common = ("--data", tiny / "tok.bin", "--save-dir", tiny / "run", "--batch", 2, "--seq", 16, "--save-every", 1)
    memcheck("smp-train", "--ckpt", tiny / "ck", *common, "--steps", 1)
    memcheck("smp-train", "--ckpt", tiny / "run", *common, "--steps", 2)
