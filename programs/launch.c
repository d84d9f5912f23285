/* programs/launch.c: starting a command on one process or under mpirun (launch.h). */
#include "launch.h"

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "cli.h"
#include "opts.h"

int launched_by_mpirun(void)
{
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
}

int launch_ranks(int argc, char **argv, int (*fn)(int argc, char **argv, par_ctx *p))
{
    const int mpi = launched_by_mpirun();
    /* serialized threads: the MPI communicator's started transfers run on a thread of
     * their own (libshard/comm/mpi.c), which checks the level MPI provides and
     * moves the data blocking when it is lower */
    int provided = 0;
    if (mpi) MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
    par_ctx P;
    shard_status s = par_init_world(&P, mpi);
    if (s) {
        int rc = cli_fail(s);
        if (mpi) MPI_Abort(MPI_COMM_WORLD, rc);
        return rc;
    }
    cli_set_rank(P.rank);
    int rc = fn(argc, argv, &P);
    if (P.size > 1 && rc != 0) {
        fflush(stdout);
        fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, rc);
    }
    par_free(&P);
    if (mpi) MPI_Finalize();
    return rc;
}

int launch_read_together(const char *val, par_ctx *P)
{
    static const char *const WORDS[] = {"no", "yes", "auto", NULL};
    int w = 2;
    int rc = cli_choice("--read-together", val, WORDS, &w);
    if (rc) return rc;
    P->read_together = w == 2 ? -1 : w;
    return 0;
}
