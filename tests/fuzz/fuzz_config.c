/* libFuzzer: config.json parsing on arbitrary bytes, and the export's edit of its dtype. */
#include "shard.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

/* A config that parsed, said to hold bf16 weights: the edit gives JSON naming bf16. */
static void edit_dtype(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (!text) return;
    memcpy(text, data, size);
    text[size] = 0;
    char *out = NULL;
    if (strlen(text) == size && shard_config_with_dtype(text, SHARD_DT_BF16, &out) == SHARD_OK && out) {
        json_t *j = json_loads(out, 0, NULL);
        json_t *a = j ? json_object_get(j, "torch_dtype") : NULL, *b = j ? json_object_get(j, "dtype") : NULL;
        if (!j || (json_is_string(a) && strcmp(json_string_value(a), "bfloat16")) ||
            (json_is_string(b) && strcmp(json_string_value(b), "bfloat16")))
            abort();
        json_decref(j);
    }
    free(out);
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    shard_model_desc d;
    shard_status s = shard_config_parse((const char *)data, size, "fuzz/config.json", &d);
    if (s == SHARD_OK) {
        edit_dtype(data, size);
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
