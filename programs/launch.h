/* programs/launch.h: starting a command on one process or under mpirun. */
#ifndef SMP_LAUNCH_H
#define SMP_LAUNCH_H

#include "par.h"

/* 1 when the environment says mpirun started this process (Open MPI, MPICH, PMIx);
 * without it a command starts no MPI at all (no singleton start-up cost). */
int launched_by_mpirun(void);
/* The main() of smp-train and smp-eval: MPI (when mpirun started the process), the
 * world, fn; an error on one rank ends every rank (the others may be waiting in a
 * collective). Returns fn's exit code. */
int launch_ranks(int argc, char **argv, int (*fn)(int argc, char **argv, par_ctx *p));
/* --read-together auto|yes|no (val NULL: auto) into P->read_together; the exit code
 * of a bad value (cli_usage), else 0. */
int launch_read_together(const char *val, par_ctx *P);

#endif
