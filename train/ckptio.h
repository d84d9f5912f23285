/* train/ckptio.c: checkpoints and run folders for smp-train and smp-eval.
 *
 * A run folder (--save-dir) holds step-NNNNNN/ checkpoints (SMP format, written
 * through libshard's atomic commit) and `latest`, a small file holding the name of
 * the newest whole one, replaced by write-temp + fsync + rename + fsync of the
 * folder, so that it always names a whole checkpoint.
 *
 * Groups written by one rank (whole tensors): "params" in each tensor's original
 * dtype, "optim/master", "optim/exp_avg", "optim/exp_avg_sq" in fp32, and "fp8"
 * (fp8.amax_history [7 * layers * 3, history], fp8.scale [7 * layers * 3]) when the
 * FP8 recipe is on.
 */
#ifndef SMP_TRAIN_CKPTIO_H
#define SMP_TRAIN_CKPTIO_H

#include "model.h"
#include "optim.h"
#include "par.h"
#include "shard.h"

/* Open the checkpoint at path on every rank of world (shard_ckpt_open_any_on: a run
 * folder's latest as rank 0 read it) and create the model it describes on backend d. */
shard_status ckptio_open_model(shard_comm *world, const char *path, shard_ckpt **out, model *m, dev *d);
/* Read every tensor of `group` ("params", "optim/master", ...) into dst (laid out
 * like m->params), converting to fp32; SHARD_E_INVALID names a missing tensor or a
 * wrong shape. *present: 0 when the group holds none of the tensors (nothing read). */
shard_status ckptio_read_group(shard_ckpt *c, const model *m, const char *group, float *dst, int *present);
/* How many of m's tensors `group` holds (0: none of them). */
size_t ckptio_group_count(shard_ckpt *c, const model *m, const char *group);
/* Tensor t of `group`: *k, its index in c, once it is found with t's (global) shape;
 * SHARD_E_INVALID naming it otherwise. */
shard_status ckptio_group_tensor(shard_ckpt *c, const char *group, const shard_tensor_spec *t, long *k);
/* The FP8 scaling state saved in c into f (scales and amax history, checked): nothing
 * when none was saved, a warning and nothing when it has another shape. */
shard_status ckptio_read_fp8(shard_ckpt *c, fp8_state *f);
/* --dump-grads: m's gradients (fp32, host or backend) into dir/grads.safetensors, with
 * the loss in its metadata; dir is created if needed. */
shard_status ckptio_write_grads(const char *dir, const model *m, double loss);
/* Threads each rank reads its boxes with: the host's cores over the ranks that share
 * the host (Open MPI says how many; else all world_size are assumed to), 1..16. */
int ckptio_load_threads(int world_size);
/* After the load: "<cmd>: loaded DIR: N bytes in T s (R GB/s)" on rank 0's stderr,
 * with the bytes every rank read and the slowest rank's time (world: NULL or the
 * world communicator); when the ranks read together, ", M bytes between the ranks"
 * after it (moved: the bytes this rank sent the others while loading). */
shard_status ckptio_print_load(const char *cmd, shard_comm *world, const shard_ckpt *c, double seconds, uint64_t moved);
/* The stored dtype of each parameter (params group) into dts[m->ntensors]. */
void ckptio_param_dtypes(shard_ckpt *c, const model *m, shard_dtype *dts);

typedef struct {
    const char *run_dir;
    int64_t step;
    const char *config_json;
    size_t config_len;
    const shard_ckpt *src;       /* extra/ files are carried over from it */
    const shard_dtype *param_dtypes;
    shard_compress compress;
    const char *training_json;
} ckptio_save_args;
/* Create the run folder (and its parents) if needed and hold its lock (run_dir/.lock,
 * flock: released when *lock_fd is closed or the process ends, however it ends): a
 * second smp-train saving into the same folder (a job started twice) is refused,
 * naming the process that holds it. A file system without flock: no lock. Once it is
 * held, the staging folders of saves that never committed (.tmp-step-*: the run was
 * killed mid-save) are removed, each with a note. */
shard_status ckptio_prepare(const char *run_dir, int *lock_fd);
/* Every rank sees the run folder that rank 0 prepared (the text of its .lock, compared;
 * collective over p->world): each save writes every rank's part into it, so a folder on
 * a host's own disk would fail the first save, after the steps before it were trained.
 * SHARD_E_USAGE on the rank that does not (the others: another rank failed). */
shard_status ckptio_check_shared(const char *run_dir, par_ctx *p);
/* Write run_dir/step-NNNNNN/ (atomic commit), then point latest at it, from every rank
 * of p at once (collective over p->world; one rank: p->size 1): rank 0 creates the
 * run folder, begins the staging folder and broadcasts it; every rank writes
 * shard-RRRRR.h5 with the pieces it stores (params where shard_partition says
 * writes, the optimizer blocks where shard_partition_optim says writes; fp8 and
 * extra/ files by rank 0); all agree; rank 0 commits and replaces latest. Every rank
 * returns the same status. */
shard_status ckptio_save(const ckptio_save_args *a, const model *m, const optim *o, par_ctx *p);
/* After a save (rank 0): *carry (closed, when not NULL) becomes the checkpoint of step
 * just written in run_dir, whose extra/ files the next save carries: the checkpoint the
 * run loaded may be gone by then (--keep prunes it; a user's clean-up script too). */
void ckptio_follow(const char *run_dir, long long step, shard_ckpt **carry);
/* Rank 0, after a save: "smp-train: saved RUN/step-N: B bytes in T s (R GB/s)" (the
 * checkpoint's bytes, every rank's files; T from the download of the state to the commit
 * of `latest`). */
void ckptio_print_save(const char *run_dir, long long step, double seconds);

/* The steps whose "kept for now" note a run has printed (each is said once). */
typedef struct {
    long long step[16];
    int n;
} ckptio_held;

/* Remove all but the newest `keep` step-NNNNNN folders of run_dir (keep 0: none
 * removed). One that another process reads (shard_ckpt_open's lock) is left for a later
 * save, with a note the first time (held: what was said). Failures are reported as
 * warnings only. */
void ckptio_prune(const char *run_dir, int keep, ckptio_held *held);

#endif
