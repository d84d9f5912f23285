/* tests/mpi/check.h: what the programs run under mpirun by tests/oracle/test_comm.py
 * share: this rank's tally (passed, failed), CHECK and OK, and their start and end.
 * Each program includes it once (static state). */
#ifndef SMP_TESTS_MPI_CHECK_H
#define SMP_TESTS_MPI_CHECK_H

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shard.h"

static int passed, failed, me; /* me: the rank in the world */

/* a check: counted; a failure printed on stderr with the rank, file and line */
#define CHECK(cond, ...) do { if (cond) passed++; else { failed++; fprintf(stderr, "rank %d: FAIL %s:%d: ", me, __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); } } while (0)
/* a call that must return SHARD_OK */
#define OK(x) CHECK((x) == SHARD_OK, "%s -> %s", #x, shard_errmsg())

/* MPI started as smp-train starts it, with serialized threads (the MPI
 * communicator's started transfers run on a thread), or without threads where
 * SMP_TEST_MPI_THREAD=single (their blocking path); the world communicator (me
 * set), or NULL with the message on stderr */
static shard_comm *check_start(int *argc, char ***argv)
{
    const char *lvl = getenv("SMP_TEST_MPI_THREAD");
    const int want = lvl && !strcmp(lvl, "single") ? MPI_THREAD_SINGLE : MPI_THREAD_SERIALIZED;
    int provided = MPI_THREAD_SINGLE;
    MPI_Init_thread(argc, argv, want, &provided);
    shard_comm *world;
    if (shard_comm_mpi_world(&world)) {
        fprintf(stderr, "%s\n", shard_errmsg());
        return NULL;
    }
    me = shard_comm_rank(world);
    CHECK(provided >= want, "MPI's thread level %d is below the %d asked for", provided, want);
    return world;
}

/* the end: every rank's tally summed on rank 0 and printed there as
 * "WHAT: P passed, F failed", world freed, MPI finalized; the exit status
 * (1 where this rank had a failure) */
static int check_finish(shard_comm *world, const char *what)
{
    int tot[2] = {passed, failed}, sum[2];
    MPI_Reduce(tot, sum, 2, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
    if (me == 0) printf("%s: %d passed, %d failed\n", what, sum[0], sum[1]);
    shard_comm_free(world);
    MPI_Finalize();
    return failed ? 1 : 0;
}

#endif
