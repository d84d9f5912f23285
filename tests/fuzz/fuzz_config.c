/* libFuzzer: config.json parsing on arbitrary bytes. */
#include "shard.h"

#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    shard_model_desc d;
    shard_status s = shard_config_parse((const char *)data, size, "fuzz/config.json", &d);
    if (s == SHARD_OK) {
        /* a description that parsed must be usable: enumerate its tensors */
        if (d.layers > 64) return 0;
        shard_tensor_spec t;
        for (size_t i = 0; i < shard_model_tensor_count(&d); i++) shard_model_tensor(&d, i, &t);
        (void)shard_model_param_count(&d);
    } else if (!shard_errmsg()[0]) {
        abort();
    }
    return 0;
}
