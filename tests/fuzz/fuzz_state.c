/* libFuzzer: the training state of a checkpoint (smp.json "training") on arbitrary
 * bytes, through smp-train's reader (train/state.c). */
#include "state.h"

#include <math.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    run_cfg c = {.batch = 8, .micro = 1, .seq = 256, .lr = 3e-4f, .steps = 1};
    shard_status s = state_parse("fuzz", (const char *)data, size, &c);
    if (s == SHARD_OK) {
        /* what was accepted is in range: the invariants smp-train relies on */
        if (c.batch < 1 || c.micro < 1 || c.batch % c.micro || c.seq < 1 || c.step < 0 || c.opt_step > c.step ||
            c.position < 0 || !isfinite(c.lr) || c.lr < 0 || !(c.eps > 0) || c.beta2 >= 1.0f || c.beta1 >= 1.0f)
            abort();
    } else if (!shard_errmsg()[0]) {
        abort();
    }
    return 0;
}
