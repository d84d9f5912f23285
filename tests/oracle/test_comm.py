"""libshard's communicator under mpirun (the MPI backend every parallel layout uses)."""
import os
import subprocess

import pytest

from conftest import BUILD

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl="self,vader")


@pytest.mark.parametrize("np_,layout", [(1, None), (3, None), (2, "tp=2"), (4, "tp=2,cp=2"),
                                        (8, "pp=2,tp=2,cp=2"), (8, "pp=2,dp=2,tp=2"), (8, "tp=2,cp=2,dp=2")])
def test_collectives_and_groups(np_, layout):
    exe = BUILD / "release" / "tests" / "mpi_test_comm" if (BUILD / "release").exists() else BUILD / "tests" / "mpi_test_comm"
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np_), str(exe)] + ([layout] if layout else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    line = [l for l in p.stdout.splitlines() if l.startswith("comm:")][-1]
    passed, failed = int(line.split()[1]), int(line.split()[3])
    assert failed == 0 and passed > 100, line


@pytest.mark.parametrize("np_,layout", [(3, None), (4, "tp=2,cp=2")])
def test_alltoallv_pairwise(np_, layout):
    """The same checks with the all-to-all's blocks sent pairwise in 2-element chunks
    (the path of counts past INT_MAX), through the test hook SMP_MPI_A2A_CHUNK."""
    exe = BUILD / "release" / "tests" / "mpi_test_comm" if (BUILD / "release").exists() else BUILD / "tests" / "mpi_test_comm"
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np_), "-x", "SMP_MPI_A2A_CHUNK", str(exe)] + ([layout] if layout else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(ENV, SMP_MPI_A2A_CHUNK="2"), timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    line = [l for l in p.stdout.splitlines() if l.startswith("comm:")][-1]
    assert int(line.split()[3]) == 0 and int(line.split()[1]) > 100, line


def test_alltoallv_one_rank_past_the_limit():
    """Only rank 0 finds its blocks past the limit: every rank must still go pairwise."""
    exe = BUILD / "release" / "tests" / "mpi_test_comm" if (BUILD / "release").exists() else BUILD / "tests" / "mpi_test_comm"
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "1", "env", "SMP_MPI_A2A_CHUNK=2", str(exe), ":",
           "-np", "2", str(exe)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    line = [l for l in p.stdout.splitlines() if l.startswith("comm:")][-1]
    assert int(line.split()[3]) == 0 and int(line.split()[1]) > 100, line


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_half_precision_reductions(np_):
    """bf16/f16 sums and maxima through MPI's user operations (fp32 per element)."""
    exe = BUILD / "release" / "tests" / "mpi_test_comm_half" if (BUILD / "release").exists() else BUILD / "tests" / "mpi_test_comm_half"
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np_), str(exe)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    line = [l for l in p.stdout.splitlines() if l.startswith("comm_half:")][-1]
    passed, failed = int(line.split()[1]), int(line.split()[3])
    assert failed == 0 and passed > 1000, line


@pytest.mark.parametrize("threads", ["serialized", "single"])
@pytest.mark.parametrize("np_,layout", [(1, None), (2, None), (3, None), (4, None), (4, "tp=2,cp=2"), (8, "tp=2,cp=4")])
def test_started_sendrecv(np_, layout, threads):
    """shard_comm_sendrecv_start / shard_comm_wait: ring passes, bytes, refusals and the
    fallback of a table without them; MPI with serialized threads (the transfer on a
    thread: the start returns before the peers have posted) and without (blocking)."""
    exe = BUILD / "release" / "tests" / "mpi_test_comm_start" if (BUILD / "release").exists() else BUILD / "tests" / "mpi_test_comm_start"
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np_), "-x", "SMP_TEST_MPI_THREAD", str(exe)] + ([layout] if layout else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(ENV, SMP_TEST_MPI_THREAD=threads), timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    line = [l for l in p.stdout.splitlines() if l.startswith("comm_start:")][-1]
    passed, failed = int(line.split()[1]), int(line.split()[3])
    assert failed == 0 and passed >= 48 * np_, line
