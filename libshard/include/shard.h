/* shard.h: the public API of libshard, the library under smp's commands.
 *
 * Conventions
 *   - Every function that can fail returns a shard_status. On failure the calling
 *     thread's error message (shard_errmsg()) names the file, the tensor and what
 *     was wrong, e.g. "model/config.json: num_attention_heads: expected a positive
 *     integer, got "8"". The library never exits, aborts or prints.
 *   - Objects are opaque handles with create/open and free/close pairs; free and
 *     close accept NULL.
 *   - Thread safety: distinct handles may be used from distinct threads; one handle
 *     is not shared between threads unless its functions say so.
 */
#ifndef SHARD_H
#define SHARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHARD_VERSION_STRING "0.1.0"

/* ------------------------------------------------------------------ status */
typedef enum {
    SHARD_OK = 0,
    SHARD_E_IO,          /* runtime: a read, write, mmap, fsync or rename failed */
    SHARD_E_NOMEM,       /* runtime: out of memory */
    SHARD_E_USAGE,       /* the caller asked for something that makes no sense */
    SHARD_E_INVALID,     /* input is malformed or violates the format's rules */
    SHARD_E_UNSUPPORTED, /* input is well-formed but uses something smp refuses */
    SHARD_E_CORRUPT,     /* a checksum or size does not match: data is damaged */
    SHARD_E_INTERNAL     /* a bug: an invariant of the library does not hold */
} shard_status;

/* The message of the calling thread's last failure ("" if none). */
const char *shard_errmsg(void);
/* A fixed name for a status: "I/O error", "invalid input", ... */
const char *shard_status_name(shard_status s);
/* The exit code a command maps a status to: 0 ok, 1 runtime, 2 usage, 3 invalid
 * or corrupt input. */
int shard_status_exit_code(shard_status s);
/* Set the thread's message (printf-style) and return s; for use by libshard's
 * parts and by commands built on it. */
shard_status shard_fail(shard_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* ------------------------------------------------------------------ dtypes */
/* The dtypes of the safetensors format. */
typedef enum {
    SHARD_DT_INVALID = 0,
    SHARD_DT_BOOL,
    SHARD_DT_U8,
    SHARD_DT_I8,
    SHARD_DT_U16,
    SHARD_DT_I16,
    SHARD_DT_U32,
    SHARD_DT_I32,
    SHARD_DT_U64,
    SHARD_DT_I64,
    SHARD_DT_F8_E4M3, /* e4m3fn: no infinities, max 448, NaN = S.1111.111 */
    SHARD_DT_F8_E5M2, /* IEEE-like: max 57344, inf and NaN */
    SHARD_DT_F16,
    SHARD_DT_BF16,
    SHARD_DT_F32,
    SHARD_DT_F64,
    SHARD_DT_COUNT
} shard_dtype;

/* "F32", "BF16", ... as safetensors spells them; NULL for an invalid dtype. */
const char *shard_dtype_name(shard_dtype dt);
/* The dtype named by s (safetensors spelling), or SHARD_DT_INVALID. */
shard_dtype shard_dtype_from_name(const char *s);
/* Bytes per element (0 for an invalid dtype). */
size_t shard_dtype_size(shard_dtype dt);
/* 1 for F8_E4M3, F8_E5M2, F16, BF16, F32, F64. */
int shard_dtype_is_float(shard_dtype dt);

/* Scalar conversions. float -> narrower: round to nearest, ties to even; NaN stays
 * NaN (sign kept); values too large become inf (F16, BF16, E5M2) or NaN (E4M3,
 * which has no inf), as ml_dtypes and torch do. Subnormals are kept. */
float shard_bf16_to_f32(uint16_t h);
uint16_t shard_f32_to_bf16(float f);
float shard_f16_to_f32(uint16_t h);
uint16_t shard_f32_to_f16(float f);
float shard_e4m3_to_f32(uint8_t b);
uint8_t shard_f32_to_e4m3(float f);
float shard_e5m2_to_f32(uint8_t b);
uint8_t shard_f32_to_e5m2(float f);

/* Convert n elements between float dtypes (or copy when dst_dt == src_dt, any
 * dtype). Conversions from F64 round once, directly from the double. Buffers
 * must not overlap. SHARD_E_USAGE for a pair that is not float -> float. */
shard_status shard_convert(void *dst, shard_dtype dst_dt, const void *src,
                           shard_dtype src_dt, size_t n);

/* The saturating, scaled quantizer of FP8 training (TransformerEngine's recipe):
 * q[i] = fp8(clamp(x[i] * scale, -max, +max)), with max 448 (E4M3) or 57344
 * (E5M2); NaN stays NaN. dt is SHARD_DT_F8_E4M3 or SHARD_DT_F8_E5M2. Returns
 * max |x[i]| (before scaling; NaN if any x is NaN). */
float shard_fp8_quantize(uint8_t *q, const float *x, size_t n, float scale, shard_dtype dt);
/* x[i] = fp8_value(q[i]) / scale. */
void shard_fp8_dequantize(float *x, const uint8_t *q, size_t n, float scale, shard_dtype dt);

/* ------------------------------------------------------------- safetensors */
/* A safetensors file opened for reading: the header is validated against every
 * rule of the reference implementation (huggingface/safetensors) and the data is
 * mapped read-only. See docs/FORMAT.md, "Inputs". */
typedef struct shard_st_file shard_st_file;

#define SHARD_ST_MAX_HEADER 100000000u /* the reference's cap on the header size */

typedef struct {
    const char *name;
    shard_dtype dtype;
    int ndim;
    const int64_t *shape;  /* ndim entries */
    uint64_t numel;
    uint64_t nbytes;
    uint64_t file_offset;  /* where the data starts in the file */
    const void *data;      /* mapped data (valid until close) */
} shard_st_tensor;

shard_status shard_st_open(const char *path, shard_st_file **out);
void shard_st_close(shard_st_file *f);
const char *shard_st_path(const shard_st_file *f);
/* Tensors in the order of their data in the file. */
size_t shard_st_count(const shard_st_file *f);
const shard_st_tensor *shard_st_at(const shard_st_file *f, size_t i);
/* NULL when absent. */
const shard_st_tensor *shard_st_find(const shard_st_file *f, const char *name);
/* __metadata__: a string -> string map (count 0 when absent). */
size_t shard_st_metadata_count(const shard_st_file *f);
void shard_st_metadata_at(const shard_st_file *f, size_t i, const char **key, const char **value);
uint64_t shard_st_file_size(const shard_st_file *f);

/* A streaming writer: declare every tensor first, then write their data in the
 * order declared. The file appears at `path` only when shard_st_writer_finish
 * succeeds (written to a temporary name, fsynced, renamed); abort removes it. */
typedef struct shard_st_writer shard_st_writer;
shard_status shard_st_writer_create(const char *path, shard_st_writer **out);
shard_status shard_st_writer_metadata(shard_st_writer *w, const char *key, const char *value);
shard_status shard_st_writer_declare(shard_st_writer *w, const char *name, shard_dtype dt,
                                     int ndim, const int64_t *shape);
/* Append raw little-endian bytes of the tensors, in declaration order. */
shard_status shard_st_writer_write(shard_st_writer *w, const void *data, size_t nbytes);
shard_status shard_st_writer_finish(shard_st_writer *w); /* frees w */
void shard_st_writer_abort(shard_st_writer *w);           /* frees w; NULL ok */

/* ------------------------------------------------------------ model folders */
/* The weights of a Hugging Face model folder: model.safetensors, or the files
 * listed by model.safetensors.index.json (names may not leave the folder; every
 * tensor in exactly one file, and every tensor of those files listed). */
typedef struct shard_weights shard_weights;
shard_status shard_weights_open(const char *dir, shard_weights **out);
void shard_weights_close(shard_weights *w);
size_t shard_weights_count(const shard_weights *w);            /* tensors, sorted by name */
const shard_st_tensor *shard_weights_at(const shard_weights *w, size_t i);
const shard_st_tensor *shard_weights_find(const shard_weights *w, const char *name);
/* The file that holds tensor i, and the list of files (in the folder). */
const char *shard_weights_file_of(const shard_weights *w, size_t i);
size_t shard_weights_file_count(const shard_weights *w);
const shard_st_file *shard_weights_file_at(const shard_weights *w, size_t i);
int shard_weights_indexed(const shard_weights *w); /* 1 when an index was used */

/* ---------------------------------------------------------------- HF config */
#define SHARD_NAME_MAX 256

/* The model description smp trains: LlamaForCausalLM and MistralForCausalLM. */
typedef struct {
    char architecture[64];   /* "LlamaForCausalLM" or "MistralForCausalLM" */
    char model_type[32];     /* "llama" or "mistral" */
    int64_t hidden;          /* hidden_size */
    int64_t intermediate;    /* intermediate_size */
    int64_t layers;          /* num_hidden_layers */
    int64_t heads;           /* num_attention_heads */
    int64_t kv_heads;        /* num_key_value_heads (default: heads) */
    int64_t head_dim;        /* head_dim (default: hidden / heads) */
    int64_t vocab;           /* vocab_size */
    int64_t max_positions;   /* max_position_embeddings */
    double rms_norm_eps;
    double rope_theta;
    int rope_llama3;         /* rope_scaling {"rope_type": "llama3", ...} */
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int64_t rope_original_max_positions;
    int tie_word_embeddings;
    int64_t sliding_window;  /* 0: none */
    double initializer_range;
    shard_dtype torch_dtype; /* SHARD_DT_INVALID when config.json names none */
} shard_model_desc;

/* Parse config.json (path names the file). Unsupported features are refused by
 * name (SHARD_E_UNSUPPORTED); wrong types and out-of-range values are
 * SHARD_E_INVALID. */
shard_status shard_config_load(const char *path, shard_model_desc *out);
shard_status shard_config_parse(const char *json, size_t len, const char *path, shard_model_desc *out);

/* The tensors a model description has, in a fixed order (embedding, then each
 * layer's, then the final norm and the head; no lm_head when tied). */
typedef enum {
    SHARD_T_EMBED, SHARD_T_Q, SHARD_T_K, SHARD_T_V, SHARD_T_O, SHARD_T_GATE, SHARD_T_UP,
    SHARD_T_DOWN, SHARD_T_NORM_ATTN, SHARD_T_NORM_MLP, SHARD_T_NORM_FINAL, SHARD_T_HEAD
} shard_tensor_role;
typedef struct {
    char name[SHARD_NAME_MAX];
    shard_tensor_role role;
    int layer;        /* -1 for embedding, final norm and head */
    int ndim;
    int64_t shape[2];
} shard_tensor_spec;
size_t shard_model_tensor_count(const shard_model_desc *d);
void shard_model_tensor(const shard_model_desc *d, size_t i, shard_tensor_spec *out);
uint64_t shard_model_param_count(const shard_model_desc *d);
/* Check that the weights are exactly the model's tensors (names and shapes, float
 * dtypes); dir is used in messages. A tied lm_head.weight that is present must
 * equal the embedding's shape; old checkpoints' rotary_emb.inv_freq buffers are
 * ignored (derived). */
shard_status shard_model_check_weights(const shard_model_desc *d, const shard_weights *w, const char *dir);

#ifdef __cplusplus
}
#endif
#endif /* SHARD_H */
