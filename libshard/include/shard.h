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
    SHARD_E_INTERNAL,    /* a bug: an invariant of the library does not hold */
    SHARD_E_CANCELLED    /* shard_cancel was called (a signal): the work stopped, its output removed */
} shard_status;

/* The message of the calling thread's last failure ("" if none). */
const char *shard_errmsg(void);
/* 1 when the thread's last failure is another process's, learned from
 * shard_comm_agree (its message says only that); 0 after any other shard_fail. */
int shard_err_secondhand(void);
/* A fixed name for a status: "I/O error", "invalid input", ... */
const char *shard_status_name(shard_status s);
/* The exit code a command maps a status to: 0 ok, 1 runtime, 2 usage, 3 invalid
 * or corrupt input, 130 cancelled (a shell's code for an interrupted command). */
int shard_status_exit_code(shard_status s);
/* Ask the process's writers to stop (async-signal-safe: for a SIGINT/SIGTERM handler;
 * sig names the signal, 0 none). Each writer stops at its next chunk and fails with
 * SHARD_E_CANCELLED, and its caller's usual failure path removes what it staged.
 * shard_cancelled: the signal asked for (-1 for 0), or 0 when none was. */
void shard_cancel(int sig);
int shard_cancelled(void);
/* SHARD_E_CANCELLED with its message ("interrupted by SIGINT") */
shard_status shard_fail_cancelled(void);
/* Set the thread's message (printf-style) and return s; for use by libshard's
 * parts and by commands built on it. */
shard_status shard_fail(shard_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* ------------------------------------------------------------------- files */
/* How durable the files that libshard writes are. All zero (or a NULL pointer where
 * one is taken) is the default: every file is fsynced before it is renamed into place
 * or committed, and the folders after, so a whole-looking output survives a power
 * loss or an OS crash. no_fsync = 1 skips every fsync, fdatasync and early writeback
 * (sync_file_range) and leaves the data to the kernel's writeback, but keeps the rest
 * of the protocol: outputs are written under temporary names and renamed only when
 * whole, so a killed process still never leaves a whole-looking output; after a crash
 * of the machine one may hold lost data. For scratch disks, outputs that a later
 * `sync` makes durable, and benchmarks that compare with a plain copy. */
typedef struct {
    int no_fsync;
} shard_write_opts;

/* Open an input file for reading: what is not a regular file (a directory, FIFO,
 * socket or device) is refused (SHARD_E_INVALID) without blocking on it; with nofollow,
 * so is a symbolic link (a file inside a checkpoint must not point outside it); a
 * missing file is SHARD_E_INVALID too. *size: its size. */
shard_status shard_open_regular(const char *path, int nofollow, int *fd, uint64_t *size);
/* n bytes at off of fd (the file at path), all of them: a file that has become shorter
 * since it was opened (changed while in use) is SHARD_E_IO naming path, as is a read error. */
shard_status shard_pread_full(int fd, const char *path, void *buf, size_t n, uint64_t off);
/* Read a whole file (at most max_bytes) into a fresh NUL-terminated buffer; a regular
 * file only (shard_open_regular); _in: with nofollow (a file of a checkpoint or run
 * folder, which must not be a link). */
shard_status shard_read_file(const char *path, size_t max_bytes, char **buf, size_t *len);
shard_status shard_read_file_in(const char *path, size_t max_bytes, int nofollow, char **buf, size_t *len);
/* The same from an open file of size bytes (read from its start; fd stays open). */
shard_status shard_read_fd(int fd, const char *path, uint64_t size, size_t max_bytes, char **buf, size_t *len);
/* Copy src to a new file dst (refused if it exists) and fsync it (o: NULL for the
 * default; no_fsync skips the fsync). */
shard_status shard_copy_file(const char *src, const char *dst, const shard_write_opts *o);
/* fsync a folder (makes the creation, renaming or removal of its entries durable);
 * _of: the folder that holds path. */
shard_status shard_fsync_dir(const char *dir);
shard_status shard_fsync_dir_of(const char *path);
/* The staging folder's name for an output folder final_dir, beside it and hidden:
 * "<parent>/.tmp-<name>-<pid>-<time>" (malloc'd; NULL when out of memory). What an
 * interrupted write leaves there is garbage (docs/FORMAT.md, "The commit protocol"). */
char *shard_staging_path(const char *final_dir);
/* 1 when entry (a name in a folder) has the form of the staging folder of a write of
 * name into that folder (".tmp-<name>-<pid>-<time>"); name NULL: of any name. */
int shard_is_staging_name(const char *entry, const char *name);
/* The staging folders that earlier writes of final_dir left beside it (folders, not
 * links): their paths, sorted; free them with shard_free_names. */
shard_status shard_staging_leftovers(const char *final_dir, char ***paths, size_t *n);
/* Whether path can name a command's output, checked before any work: never empty nor
 * a link to nothing, never in a checkpoint's folder (one with smp.json); NEW_DIR (a
 * checkpoint or export, renamed into place when whole): not ".", ".." or "/", nothing
 * there yet (not even a link), in an existing folder; DIR (a run folder, made with its
 * parents): a folder if there and not a checkpoint, no file on the way;
 * FILE (a log, appended to; perhaps in the run folder, made later): not a folder if
 * there, no file on the way. SHARD_E_USAGE
 * naming path otherwise (SHARD_E_IO where it cannot be looked at). */
typedef enum { SHARD_OUT_NEW_DIR, SHARD_OUT_DIR, SHARD_OUT_FILE } shard_out_kind;
shard_status shard_check_output(const char *path, shard_out_kind kind);
/* Remove a folder and everything under it (best effort; for staging folders): the
 * bytes of the files removed. A link (path itself too) is removed, never followed.
 * tree_bytes: the same count, nothing removed. */
uint64_t shard_remove_tree(const char *path);
uint64_t shard_tree_bytes(const char *path);
/* The names in folder dir that keep(name, ctx) accepts ("." and ".." never), sorted;
 * free them with shard_free_names. A folder that cannot be opened is SHARD_E_IO. */
shard_status shard_list_dir(const char *dir, int (*keep)(const char *name, void *ctx), void *ctx, char ***names,
                            size_t *n);
void shard_free_names(char **names, size_t n);

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

/* XXH64 of the 8 bytes of h (little-endian) followed by len bytes of data: a stream's
 * fingerprint, chained block by block (h = shard_hash64(h, block, n), from 0). */
uint64_t shard_hash64(uint64_t h, const void *data, size_t len);

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
/* shard_convert for a dst that will not be read again soon (a load's weights, written
 * into memory fresh from the kernel): long runs of BF16 -> F32 are stored past the
 * CPU's caches (no read of each line before it is written); the same values. */
shard_status shard_convert_uncached(void *dst, shard_dtype dst_dt, const void *src,
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
 * mapped read-only. See docs/DESIGN.md, "Inputs are hostile", and README.md, "libshard". */
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
/* Same, with the durability of finish given (o: NULL for the default). */
shard_status shard_st_writer_create_opts(const char *path, const shard_write_opts *o, shard_st_writer **out);
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
size_t shard_weights_index(const shard_weights *w, const char *name); /* its i; count when absent */
/* The file that holds tensor i, and the list of files (in the folder). */
const char *shard_weights_file_of(const shard_weights *w, size_t i);
size_t shard_weights_file_count(const shard_weights *w);
const shard_st_file *shard_weights_file_at(const shard_weights *w, size_t i);
int shard_weights_indexed(const shard_weights *w); /* 1 when an index was used */
/* A fingerprint of the weights (for shard_agree_check): per tensor, by name, its name,
 * dtype and shape and its first and last 4 KiB (a smaller one whole), read from the
 * files. Copies of one model agree however they are split into files; another revision
 * or a fine-tune of the same shapes differs in the bytes sampled. */
shard_status shard_weights_fingerprint(const shard_weights *w, uint64_t *out);

/* ---------------------------------------------------------------- HF config */
#define SHARD_NAME_MAX 256

/* rope_scaling's types smp computes (the numbers are kernels/ops.h's OP_ROPE_*) */
enum { SHARD_ROPE_DEFAULT = 0, SHARD_ROPE_LLAMA3 = 1, SHARD_ROPE_YARN = 2, SHARD_ROPE_LINEAR = 3 };

/* The model description smp trains: LlamaForCausalLM, MistralForCausalLM,
 * Qwen2ForCausalLM, Qwen3ForCausalLM and GPTNeoXForCausalLM (the families:
 * shard_family_of). */
typedef struct {
    char architecture[64];   /* "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", ... */
    char model_type[32];     /* "llama", "mistral", "qwen2", "qwen3", "gpt_neox" */
    int64_t hidden;          /* hidden_size */
    int64_t intermediate;    /* intermediate_size */
    int64_t layers;          /* num_hidden_layers */
    int64_t heads;           /* num_attention_heads */
    int64_t kv_heads;        /* num_key_value_heads (default: heads) */
    int64_t head_dim;        /* head_dim (default: hidden / heads) */
    int64_t vocab;           /* vocab_size */
    int64_t max_positions;   /* max_position_embeddings */
    double norm_eps;         /* rms_norm_eps (GPT-NeoX: layer_norm_eps) */
    double rope_theta;
    int rope_type;           /* SHARD_ROPE_*: rope_scaling's (or rope_parameters') rope_type */
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor; /* llama3's; factor also yarn's, linear's */
    int64_t rope_original_max_positions; /* llama3, yarn: original_max_position_embeddings */
    double rope_beta_fast, rope_beta_slow; /* yarn (0: transformers' 32 and 1) */
    int rope_truncate;       /* yarn: truncate (default true) */
    double rope_attention_factor, rope_mscale, rope_mscale_all_dim; /* yarn (0: not given) */
    int tie_word_embeddings;
    int64_t sliding_window;  /* 0: none */
    double initializer_range;
    int64_t pad_token_id;    /* -1 when absent, null, or outside the vocabulary */
    int64_t eos_token_id;    /* the same; a list's first id (the end of text; --documents' default separator) */
    shard_dtype torch_dtype; /* SHARD_DT_INVALID when config.json names none */
    int qkv_bias;            /* q, k and v projections have biases (Qwen2) */
    int qk_norm;             /* RMSNorm of each query and key head before RoPE (Qwen3) */
    /* GPT-NeoX */
    int fused_qkv;           /* one query_key_value projection: per head, its q, k and v rows */
    int linear_bias;         /* biases on every linear of the blocks (qkv, o, both of the MLP) */
    int layer_norm;          /* LayerNorm with bias instead of RMSNorm (every norm) */
    int gelu_mlp;            /* MLP down(gelu(up x)) (exact GELU) instead of SwiGLU */
    int parallel_residual;   /* x + attn(ln1 x) + mlp(ln2 x) instead of the two residuals in turn */
    int64_t rotary_dim;      /* dims of each head that RoPE rotates: head_dim, or int(head_dim * rotary_pct) */
    /* Mixture of experts (Mixtral, Qwen3-MoE): every layer's MLP is `experts` SwiGLU
     * experts of moe_intermediate each; a token goes to its experts_per_tok experts of
     * highest router probability, weighted by those probabilities (renormalized to sum
     * to one when norm_topk_prob) */
    int64_t experts;         /* num_local_experts / num_experts; 0: a dense MLP */
    int64_t experts_per_tok; /* num_experts_per_tok */
    int64_t moe_intermediate; /* Mixtral: intermediate_size; Qwen3-MoE: moe_intermediate_size */
    int norm_topk_prob;
    double router_aux_loss_coef;
    int output_router_logits; /* transformers adds the load-balancing loss to the loss only then */
} shard_model_desc;

/* Parse config.json (path names the file). Unsupported features are refused by
 * name (SHARD_E_UNSUPPORTED); wrong types and out-of-range values are
 * SHARD_E_INVALID. */
shard_status shard_config_load(const char *path, shard_model_desc *out);
shard_status shard_config_parse(const char *json, size_t len, const char *path, shard_model_desc *out);
/* As shard_config_load, also giving the file's text (malloc'd; NULL on failure): what
 * was parsed is exactly what a checkpoint made from it stores. */
shard_status shard_config_read(const char *path, shard_model_desc *out, char **text, size_t *len);
/* The description in config.json's terms (dimensions, max_position_embeddings,
 * the norm's eps, rope_theta, rope_scaling, tie_word_embeddings, sliding_window,
 * torch_dtype): a new jansson object (json_t *) for the caller to json_decref. */
void *shard_config_json(const shard_model_desc *d);
/* config.json's name of a torch_dtype ("bfloat16"), or NULL. */
const char *shard_torch_dtype_name(shard_dtype dt);
/* config.json (NUL-terminated text) saying its weights are dt: *out a new text
 * (malloc'd) where the file's torch_dtype or dtype named another type, every
 * other byte as given when the text allows, else NULL (nothing to change: no such
 * key, the same type already, or dt not one of config.json's types). */
shard_status shard_config_with_dtype(const char *json, shard_dtype dt, char **out);

/* The tensors a model description has, in a fixed order (embedding, then each
 * layer's, then the final norm and the head; no lm_head when tied). */
typedef enum {
    SHARD_T_EMBED, SHARD_T_Q, SHARD_T_K, SHARD_T_V, SHARD_T_O, SHARD_T_GATE, SHARD_T_UP,
    SHARD_T_DOWN, SHARD_T_NORM_ATTN, SHARD_T_NORM_MLP, SHARD_T_NORM_FINAL, SHARD_T_HEAD,
    SHARD_T_Q_BIAS, SHARD_T_K_BIAS, SHARD_T_V_BIAS, /* [q width], [kv width] */
    SHARD_T_Q_NORM, SHARD_T_K_NORM,                 /* [head_dim] */
    SHARD_T_QKV, SHARD_T_QKV_BIAS,                  /* GPT-NeoX: [3 q width, hidden], [3 q width] */
    SHARD_T_O_BIAS, SHARD_T_UP_BIAS, SHARD_T_DOWN_BIAS,
    SHARD_T_NORM_ATTN_BIAS, SHARD_T_NORM_MLP_BIAS, SHARD_T_NORM_FINAL_BIAS, /* LayerNorm's */
    SHARD_T_ROUTER,                                 /* [experts, hidden] */
    SHARD_T_EXPERT_GATE, SHARD_T_EXPERT_UP, SHARD_T_EXPERT_DOWN, /* one expert's: [moe_intermediate, hidden], [hidden, ...] */
    SHARD_T_ROLES
} shard_tensor_role;
typedef struct {
    char name[SHARD_NAME_MAX];
    shard_tensor_role role;
    int layer;        /* -1 for embedding, final norm and head */
    int expert;       /* an expert's tensor: its expert; -1 otherwise */
    int ndim;
    int64_t shape[2];
} shard_tensor_spec;
/* A family: its tensors by Hugging Face name ("%d": the layer, and then the expert
 * for a role of one expert) and role. */
typedef struct {
    const char *fmt;
    shard_tensor_role role;
} shard_layer_tensor;
/* config.json's sliding_window: none; on every layer (Mistral); only with
 * use_sliding_window, which smp refuses (Qwen) */
typedef enum { SHARD_WINDOW_NONE, SHARD_WINDOW_ALL, SHARD_WINDOW_OPTIONAL } shard_window_rule;
typedef struct {
    const char *architecture, *model_type;
    const shard_layer_tensor *layer;   /* one layer's */
    size_t nlayer;
    const shard_layer_tensor *outer;   /* the others: the embedding first, then the final norm('s), then the head */
    size_t nouter;
    const char *const *derived;        /* buffers older checkpoints hold that smp ignores ("%d": the layer) */
    shard_window_rule sliding_window;
    /* the shard_model_desc features the family always has */
    int qkv_bias, qk_norm, fused_qkv, linear_bias, layer_norm, gelu_mlp;
    int moe;                           /* 1: experts (Mixtral: renormalized top-k always), 2: Qwen3-MoE's keys */
    const char *eps_key;               /* config.json's name of the norm's eps */
    const char *hidden_act;            /* the one activation it implements */
} shard_family;
const shard_family *shard_family_of(const char *architecture); /* NULL: not supported */
const char *shard_family_names(void);                          /* for messages */
/* The shape of a tensor of role in d (the role table, partition.c); its ndim. */
int shard_role_shape(const shard_model_desc *d, shard_tensor_role role, int64_t shape[2]);
/* How `smp-convert init` fills a role, as transformers initializes it. */
typedef enum { SHARD_INIT_NORMAL, SHARD_INIT_ONES, SHARD_INIT_ZEROS } shard_init_rule;
shard_init_rule shard_role_init(shard_tensor_role role);
/* 1: every tensor-parallel rank holds the role's tensors whole */
int shard_role_replicated(shard_tensor_role role);
/* 1: the role is one expert's (its names take the layer and the expert) */
int shard_role_per_expert(shard_tensor_role role);
size_t shard_model_tensor_count(const shard_model_desc *d);
void shard_model_tensor(const shard_model_desc *d, size_t i, shard_tensor_spec *out);
uint64_t shard_model_param_count(const shard_model_desc *d);
/* Check that the weights are exactly the model's tensors (names and shapes, float
 * dtypes); dir is used in messages. A tied lm_head.weight that is present must
 * equal the embedding's shape; old checkpoints' derived buffers (rotary_emb.inv_freq,
 * GPT-NeoX's attention masks) are ignored. */
shard_status shard_model_check_weights(const shard_model_desc *d, const shard_weights *w, const char *dir);

/* ------------------------------------------------------------------ layouts */
/* A parallel layout: pp pipeline stages x dp data-parallel replicas x cp context-
 * parallel ranks x tp tensor-parallel ranks. Rank order, fastest first: tp, cp, dp, pp:
 *   rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
 * so that a tensor-parallel group sits on one node. */
typedef struct {
    int pp, tp, cp, dp;
    /* expert parallelism (a mixture of experts): each layer's experts split over ep of
     * the dp*cp ranks of a (pp, tp) position; not a dimension of its own (the world is
     * pp*tp*cp*dp). 0 or 1: none (shard_layout_ep) */
    int ep;
} shard_layout;
typedef struct {
    int pp, tp, cp, dp;
} shard_coords;

/* "pp=2,tp=4[,cp=1][,dp=1][,ep=1]" in any order, each at most once; missing ones are 1. */
shard_status shard_layout_parse(const char *text, shard_layout *out);
/* "pp=2,tp=4,cp=1,dp=1" (buf of at least 64 bytes). */
const char *shard_layout_format(const shard_layout *l, char *buf, size_t cap);
int shard_layout_size(const shard_layout *l);
#define SHARD_MAX_EP 1024
int shard_layout_ep(const shard_layout *l); /* ep, 1 when 0 */
/* Expert parallelism: the rank's index q = dp * cp + cp among the dp*cp ranks of its
 * (pp, tp) position; its ep rank q % ep holds experts [ep rank * E/ep, +E/ep), and the
 * ranks with one q % ep replicate those experts (q < ep writes them). */
int shard_layout_ep_rank(const shard_layout *l, shard_coords c);
shard_coords shard_layout_coords(const shard_layout *l, int rank);
int shard_layout_rank(const shard_layout *l, shard_coords c);

/* Pipeline stages: layers_per_stage[pp] (sum = layers). The first stage also holds
 * the embedding, the last the final norm and the head. */
#define SHARD_MAX_PP 1024
/* spec: "auto" (the cost model below) or "8,8,7,9" (explicit, pp numbers >= 1). */
shard_status shard_stages_parse(const char *spec, const shard_model_desc *d, int pp, int *layers_per_stage);
/* Balance the stages by a cost model: each layer costs its matmul flops per token
 * (attention + MLP) plus its parameter bytes; the embedding costs its parameter
 * bytes on stage 0, the head its flops and bytes on the last stage. Minimizes the
 * largest stage cost over contiguous splits (every stage gets at least one layer). */
shard_status shard_stages_auto(const shard_model_desc *d, int pp, int *layers_per_stage);
/* The stage that holds layer l. */
int shard_stage_of_layer(const int *layers_per_stage, int pp, int layer);

/* Refuse layouts that cannot hold the model, naming why: tp must divide the number
 * of attention heads, and either divide or be a multiple of the kv heads; pp may not
 * exceed the number of layers; every count >= 1; sizes bounded. */
shard_status shard_layout_check(const shard_layout *l, const shard_model_desc *d);

/* ------------------------------------------------------------------- boxes */
#define SHARD_MAX_DIMS 8
/* A box of a tensor: off[k] <= index[k] < off[k] + len[k] for every dim k. */
typedef struct {
    int ndim;
    int64_t off[SHARD_MAX_DIMS];
    int64_t len[SHARD_MAX_DIMS];
} shard_box;
uint64_t shard_box_numel(const shard_box *b);
/* 1 and out = a ∩ b when they overlap in a non-empty box; 0 otherwise. */
int shard_box_intersect(const shard_box *a, const shard_box *b, shard_box *out);
/* Copy the elements of box x from src, which holds box sbox (C order) in dtype sdt,
 * into dst, which holds box dbox (C order) in ddt, converting as shard_convert does;
 * x lies inside both. */
shard_status shard_box_copy(void *dst, shard_dtype ddt, const shard_box *dbox, const void *src, shard_dtype sdt,
                            const shard_box *sbox, const shard_box *x);

/* The piece of a model tensor that a rank holds in a layout.
 *   holds: 0 when the rank holds none of it (another stage's tensor)
 *   box:   the region of the GLOBAL (unpadded) tensor it holds; may be empty
 *          (len 0) for the last vocab-parallel rank when the vocabulary is small
 *   writes: 1 when this rank is the one that stores this region in a checkpoint
 *          (the lowest rank holding it: tp-replicated kv heads and norms, and every
 *          cp/dp replica, are written once)
 * Partition rules (HF names): embedding and lm_head split dim 0 in tp blocks of
 * ceil(V/tp) rows (vocab padded to a multiple of tp at run time, padding never
 * stored); q/k/v/gate/up split dim 0 by whole heads (kv heads replicated tp/kv
 * times when fewer than tp; gate/up in blocks of ceil(F/tp) rows); o_proj and
 * down_proj split dim 1 the same way; norms replicated. With tied embeddings and
 * pp > 1 the last stage holds a copy of the embedding (writes = 0 there). */
typedef struct {
    int holds;
    int writes;
    shard_box box;
} shard_piece;
shard_status shard_partition(const shard_model_desc *d, const shard_layout *l, const int *layers_per_stage,
                             const shard_tensor_spec *t, int rank, shard_piece *out);
/* The optimizer state's piece (fp32 master weights, Adam m and v; ZeRO-1): the
 * parameter piece of the rank's (pp, tp) position split along dim 0 into dp*cp
 * blocks of ceil(rows / (dp*cp)) rows; the rank at dp index i, cp index j holds
 * block i*cp + j. writes: as for the parameters over tp (replicated kv heads and
 * norms stored once, the tied copy not at all), and every block by its own rank. */
shard_status shard_partition_optim(const shard_model_desc *d, const shard_layout *l, const int *layers_per_stage,
                                   const shard_tensor_spec *t, int rank, shard_piece *out);

/* --------------------------------------------------------------- checkpoints */
/* The SMP checkpoint format, version 2 (docs/FORMAT.md has it field by field):
 *   CKPT/smp.json          manifest, written last: its presence means "whole"
 *   CKPT/shard-RRRRR.h5    the pieces written by rank RRRRR (HDF5; one dataset per
 *                          piece under /params, /optim/master, /optim/exp_avg,
 *                          /optim/exp_avg_sq, /fp8; chunked, shuffle + zstd
 *                          (filter 32015); attributes: tensor, dtype, offset,
 *                          global_shape, xxh64, chunk_xxh3)
 *   CKPT/extra/...         the model folder's other files (tokenizer, ...), verbatim
 * A checkpoint is written into <parent>/.tmp-<name>-<nonce>/ and renamed into place
 * once every file and the manifest are fsynced (unless no_fsync: shard_write_opts). */
#define SHARD_FORMAT_NAME "smp"
/* 2: files[] carry "xxh3_blocks", a checksum the writer computes without reading its
 * file back (docs/FORMAT.md); version 1 ("xxh64": the whole file's XXH64; minor 1:
 * per-chunk XXH3) is still read. Writers write version 2, minor 0. */
#define SHARD_FORMAT_VERSION 2
#define SHARD_FORMAT_VERSION_OLDEST 1
#define SHARD_FORMAT_MINOR 0

/* Options of a shard file writer. Compression: level 0 = none, else zstd level 1..19. */
typedef struct {
    int zstd_level;
    int threads;  /* worker threads that fill, shuffle and compress chunks (>= 1) */
    int no_fsync; /* as shard_write_opts: close neither fsyncs nor starts writeback */
    int planes;   /* 1: zstd's match finder tuned for byte planes of numbers (the default
                   * "zstd"; docs/FORMAT.md), 0: zstd's own parameters of the level */
} shard_compress;
/* "none", "zstd" (level 1 with planes = 1) or "zstd:N" (plain level N); sets threads
 * to 1 and no_fsync to 0. */
shard_status shard_compress_parse(const char *text, shard_compress *out);

/* One shard file being written (by one rank). */
typedef struct shard_h5_writer shard_h5_writer;
shard_status shard_h5_create(const char *path, shard_compress c, shard_h5_writer **out);
/* Write the piece `box` of tensor `name` (group "params", "optim/master", ...) of the
 * tensor of shape gshape, taking it from a buffer holding exactly the box (C order,
 * dtype src_dt), converting to dt. Streams in chunks. */
shard_status shard_h5_write_local(shard_h5_writer *w, const char *group, const char *name, shard_dtype dt,
                                  int ndim, const int64_t *gshape, const shard_box *box,
                                  const void *local, shard_dtype src_dt);
/* Same, from a callback that fills any sub-box of the piece (C order, dtype dt);
 * it is called from several threads at once when threads > 1. */
typedef shard_status (*shard_fill_fn)(void *ctx, const shard_box *sub, void *dst, shard_dtype dt);
shard_status shard_h5_write_stream(shard_h5_writer *w, const char *group, const char *name, shard_dtype dt,
                                   int ndim, const int64_t *gshape, const shard_box *box,
                                   shard_fill_fn fill, void *ctx);
/* Several pieces, to one writer or several, as one stream of chunks: the workers fill
 * the next piece's first chunks while the last ones of the previous are written (no
 * draining between pieces). Each file receives its pieces in the order listed: the
 * same file as one shard_h5_write_stream call each. done (may be NULL) is called once
 * per chunk written, one call at a time, with the chunk's bytes (dtype dt). The first
 * piece's writer sets the threads. */
typedef struct {
    shard_h5_writer *w;
    const char *group, *name;
    shard_dtype dt;
    int ndim;
    const int64_t *gshape;
    shard_box box;
    shard_fill_fn fill;
    void *ctx;
} shard_h5_piece;
shard_status shard_h5_write_pieces(const shard_h5_piece *pieces, size_t n, void (*done)(void *arg, uint64_t bytes),
                                   void *arg);
/* Flushes, computes the file's XXH64 (kept beside it for shard_ckpt_commit, which
 * would otherwise read the file again) and fsyncs (unless no_fsync); frees w. */
shard_status shard_h5_close(shard_h5_writer *w);
void shard_h5_abort(shard_h5_writer *w);

/* A checkpoint opened for reading: the manifest is parsed and validated (format
 * and version, paths that stay in the folder, pieces inside their tensors, every
 * element stored exactly once). */
typedef struct shard_ckpt shard_ckpt;
typedef struct {
    const char *name;    /* "model.embed_tokens.weight" */
    const char *group;   /* "params", "optim/master", ... */
    shard_dtype dtype;
    int ndim;
    int64_t shape[SHARD_MAX_DIMS];
    size_t npieces;
} shard_ckpt_tensor;
shard_status shard_ckpt_open(const char *dir, shard_ckpt **out);
/* The checkpoint that path names: path itself (it has smp.json) or, for a run folder,
 * the step folder its `latest` names (one name, no '/', a folder of the run, not a
 * link; `latest` a regular file of at most 4 KiB holding only that name and line
 * ends). *ckpt_dir: malloc'd. SHARD_E_INVALID when path is neither, or for a
 * `latest` that is not such a file. _open_any: resolve, then shard_ckpt_open (what
 * every command that reads a checkpoint takes; shard_ckpt_dir names the one opened). */
shard_status shard_ckpt_resolve(const char *path, char **ckpt_dir);
shard_status shard_ckpt_open_any(const char *path, shard_ckpt **out);
typedef struct shard_comm shard_comm; /* (the communicators, below) */
/* The same on every rank of world (collective; NULL or one rank: open_any): a run
 * folder's `latest` as rank 0 read it, whose checkpoint rank 0 holds open (its lock)
 * while the others open it. A rank that looked itself could find `latest` moved to a
 * newer step (a run training there) and load another checkpoint. Each rank opens under
 * its own path (copies on each host are fine; shard_agree_check compares them). */
shard_status shard_ckpt_open_any_on(shard_comm *world, const char *path, shard_ckpt **out);
void shard_ckpt_close(shard_ckpt *c);
const char *shard_ckpt_dir(const shard_ckpt *c);
const shard_model_desc *shard_ckpt_model(const shard_ckpt *c);
const shard_layout *shard_ckpt_layout(const shard_ckpt *c);
const int *shard_ckpt_stages(const shard_ckpt *c);
/* The config.json stored verbatim (NUL-terminated). */
const char *shard_ckpt_config_json(const shard_ckpt *c);
size_t shard_ckpt_tensor_count(const shard_ckpt *c);
const shard_ckpt_tensor *shard_ckpt_tensor_at(const shard_ckpt *c, size_t i);
/* index or -1; group NULL means "params" */
long shard_ckpt_find(const shard_ckpt *c, const char *group, const char *name);
/* Read the box `want` of tensor i into dst (C order of the box, dtype dst_dt):
 * the planner intersects the stored pieces with the box and reads only the chunks
 * that the box touches, each checked against its own XXH3 (a piece written before
 * chunk checksums is read whole once, the first time it is touched, and its xxh64
 * checked). Safe to call from several threads at once on one c; memory: a chunk or
 * two per thread. */
shard_status shard_ckpt_read(shard_ckpt *c, size_t i, const shard_box *want, void *dst, shard_dtype dst_dt);
/* Threads that each shard_ckpt_read (the chunks of one call) and shard_ckpt_verify
 * (the files) use: 1 (the default) reads in the calling thread. */
void shard_ckpt_set_threads(shard_ckpt *c, int threads);
/* on: the boxes read are not read again soon (a load of the whole model), so
 * conversions into them go by shard_convert_uncached. Off by default. */
void shard_ckpt_set_uncached(shard_ckpt *c, int on);
/* Cuts of dim 0 of tensor i's rows [lo, hi) into parts bands that readers can take
 * one each without two of them reading one chunk: cuts[0] = lo <= cuts[1] <= ... <=
 * cuts[parts] = hi, each inner cut at the start of a chunk of a stored piece (as
 * smp's writer chunks them) nearest to an even split (bands may be empty). A pure
 * function of the manifest: every process computes the same cuts. */
shard_status shard_ckpt_row_cuts(const shard_ckpt *c, size_t i, int64_t lo, int64_t hi, int parts, int64_t *cuts);
/* Bytes of shard files read so far (as stored: compressed where compressed). */
uint64_t shard_ckpt_bytes_read(const shard_ckpt *c);
/* Every whole-file checksum, every chunk's and piece's checksum, and coverage; each
 * file read once, front to back. */
shard_status shard_ckpt_verify(shard_ckpt *c, uint64_t *bytes_checked);
/* Files kept beside the weights (tokenizer, ...): relative names under extra/. */
size_t shard_ckpt_extra_count(const shard_ckpt *c);
const char *shard_ckpt_extra_at(const shard_ckpt *c, size_t i);
/* Copy extra file i to a new file dst, checked as it is copied (a regular file, no
 * link, of the manifest's size and XXH64: else SHARD_E_CORRUPT and nothing at dst). */
shard_status shard_ckpt_copy_extra(const shard_ckpt *c, size_t i, const char *dst, const shard_write_opts *o);
/* Check extra file i the same way without copying it. */
shard_status shard_ckpt_check_extra(const shard_ckpt *c, size_t i);
/* The "training" object as JSON text (NUL-terminated, owned by c), or NULL. */
const char *shard_ckpt_training_json(const shard_ckpt *c);
/* Raw manifest (for smp-inspect --json), without "tensors": what the reader keeps of
 * them is c's tensors and pieces (shard_ckpt_tensor_at). */
const void *shard_ckpt_manifest_json(const shard_ckpt *c); /* a json_t* */
/* The manifest's "tensors" array, read again from smp.json (*out: a json_t*, to
 * json_decref); SHARD_E_INVALID when smp.json no longer holds the bytes c was opened from. */
shard_status shard_ckpt_manifest_tensors(const shard_ckpt *c, void **out);
/* XXH64 of smp.json's bytes as read: one value for one checkpoint (its manifest holds
 * every file's checksum), which the ranks of a run compare (a host's stale copy). */
uint64_t shard_ckpt_fingerprint(const shard_ckpt *c);
/* An open checkpoint holds a shared flock on its smp.json, so that a training run's
 * --keep does not remove it while it is read (smp-train takes the lock exclusively
 * before it prunes a step folder, and leaves one it cannot take for a later save).
 * unlock: released early, by a reader that needs nothing more from the files (what
 * is in memory stays valid). shard_ckpt_close releases it too. */
void shard_ckpt_unlock(shard_ckpt *c);

/* Writing a checkpoint. begin: make <parent>/.tmp-<name>-<nonce>/ (the staging
 * folder, where shard files are written by any number of processes); commit: scan
 * the shard files' attributes into smp.json (with checksums of every piece and
 * file), fsync everything, rename the folder to `final_dir`, fsync the parent.
 * A final_dir that already exists is refused (SHARD_E_USAGE) unless overwrite.
 * begin_opts: o->no_fsync skips the fsyncs of the extra files, the manifest and the
 * folders (the shard files' writers have their own no_fsync, shard_compress). */
typedef struct shard_ckpt_writer shard_ckpt_writer;
shard_status shard_ckpt_begin(const char *final_dir, shard_ckpt_writer **out);
shard_status shard_ckpt_begin_opts(const char *final_dir, const shard_write_opts *o, shard_ckpt_writer **out);
const char *shard_ckpt_staging(const shard_ckpt_writer *w);
/* Copy a file of the model folder into extra/ (checksummed at commit). */
shard_status shard_ckpt_add_extra(shard_ckpt_writer *w, const char *src_path, const char *rel_name);
/* Carry extra file i of checkpoint src into extra/, checked (shard_ckpt_copy_extra). */
shard_status shard_ckpt_carry_extra(shard_ckpt_writer *w, const shard_ckpt *src, size_t i);
/* Every extra file of src, so. */
shard_status shard_ckpt_carry_extras(shard_ckpt_writer *w, const shard_ckpt *src);
/* The other files of a Hugging Face model folder (tokenizer, generation config, ...):
 * every regular file but hidden ones, config.json, *.safetensors and
 * model.safetensors.index.json, each as shard_ckpt_add_extra. */
shard_status shard_ckpt_add_folder_extras(shard_ckpt_writer *w, const char *model_dir);
/* training_json: the training state as a JSON object text (step, tokens, data
 * position, RNG, schedule, fp8 scaling, optimizer hyper-parameters ...), stored
 * under "training"; NULL for a checkpoint of weights only. */
shard_status shard_ckpt_commit(shard_ckpt_writer *w, const char *config_json, size_t config_len,
                               const shard_model_desc *d, const shard_layout *l, const int *stages,
                               const char *training_json, int overwrite);
/* On success commit frees w; on failure w stays valid and the caller aborts it. */
void shard_ckpt_abort(shard_ckpt_writer *w); /* removes the staging folder, frees w */

/* ------------------------------------------------------------ communicators */
/* One interface for the collectives and point-to-point transfers that parallel
 * training needs, with backends: a single process ("self"), MPI (CPU buffers,
 * any number of hosts), and NCCL (GPU buffers; backends/cuda/nccl.c, built with the
 * CUDA backend).
 * Every call counts the bytes it moves (what this rank sends), so a run can log
 * its communication volume per kind. Calls are collective over the communicator
 * unless they say otherwise; buffers are in host memory for self and MPI. */
/* shard_comm: typedef above (shard_ckpt_open_any_on takes one) */
typedef enum { SHARD_OP_SUM, SHARD_OP_MAX } shard_op;

/* A communicator of one process. */
shard_status shard_comm_self(shard_comm **out);
/* MPI_COMM_WORLD (MPI must be initialized by the program; errors come back as
 * statuses, not aborts). */
shard_status shard_comm_mpi_world(shard_comm **out);
void shard_comm_free(shard_comm *c);
int shard_comm_rank(const shard_comm *c);
int shard_comm_size(const shard_comm *c);
/* Processes with the same color form a new communicator, ordered by key. */
shard_status shard_comm_split(shard_comm *c, int color, int key, shard_comm **out);

/* In place: buf[n] of dt reduced over all ranks (F32, F64, I32, I64, U64; BF16 and
 * F16 too, which MPI reduces element by element in fp32). */
shard_status shard_comm_allreduce(shard_comm *c, void *buf, size_t n, shard_dtype dt, shard_op op);
/* send[n * size] -> recv[n]: rank r receives the reduction of block r. */
shard_status shard_comm_reduce_scatter(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt, shard_op op);
/* send[n] -> recv[n * size], rank r's block at r*n. */
shard_status shard_comm_allgather(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt);
shard_status shard_comm_broadcast(shard_comm *c, void *buf, size_t n, shard_dtype dt, int root);
/* Point to point (not collective): matched by peer and tag. */
shard_status shard_comm_send(shard_comm *c, const void *buf, size_t n, shard_dtype dt, int peer, int tag);
shard_status shard_comm_recv(shard_comm *c, void *buf, size_t n, shard_dtype dt, int peer, int tag);
/* Send to one peer and receive from another at once (ring passes). */
shard_status shard_comm_sendrecv(shard_comm *c, const void *send, int to, void *recv, int from, size_t n,
                                 shard_dtype dt, int tag);
/* Nonblocking sendrecv (ring passes that overlap compute): the same arguments,
 * checks and byte count; *req is set on success (NULL on failure: nothing moves).
 * Until shard_comm_wait(*req) returns, send must not be written nor recv touched,
 * and the caller makes no other communicator call (on any communicator: the MPI
 * backend's worker thread may be inside MPI). One transfer in flight per
 * communicator. Backends without it (NCCL, the CUDA wrapper) and MPI without
 * thread support move the data at start and wait does nothing. */
typedef struct shard_comm_req shard_comm_req;
shard_status shard_comm_sendrecv_start(shard_comm *c, const void *send, int to, void *recv, int from, size_t n,
                                       shard_dtype dt, int tag, shard_comm_req **req);
/* The end of a started transfer, with its status; req is then spent. NULL: SHARD_OK. */
shard_status shard_comm_wait(shard_comm_req *req);
/* All-to-all with counts (in elements of dt): send + sdispls[r] (scounts[r] elements) goes
 * to rank r; recv + rdispls[r] (rcounts[r] elements) comes from rank r. Counts may be 0;
 * the caller knows rcounts (e.g. from an all-to-all of the counts first). Collective;
 * the send and receive regions must not overlap. */
shard_status shard_comm_alltoallv(shard_comm *c, const void *send, const size_t *scounts, const size_t *sdispls,
                                  void *recv, const size_t *rcounts, const size_t *rdispls, shard_dtype dt);
shard_status shard_comm_barrier(shard_comm *c);
/* Did any rank fail? Each rank gives its own status (mine) and every rank learns the
 * answer: mine when it is a failure; else, when another rank failed, the highest
 * status among the failures, with the message `others` ("another process failed"),
 * and *theirs (may be NULL) set to 1; else SHARD_OK. A failing collective is this
 * rank's own failure (SHARD_E_IO). One rank: mine. */
shard_status shard_comm_agree(shard_comm *c, shard_status mine, const char *others, int *theirs);
/* What the processes of one run must hold alike, compared once before the work: each
 * opens its inputs and parses its flags itself, so on a cluster a host's stale copy
 * (of a checkpoint, a model folder, a token file) or an MPMD launch with other flags
 * would otherwise produce, silently, a mix of them (or hang in the first collective of
 * a layout the others do not share). */
typedef enum {
    SHARD_AGREE_CKPT,  /* a checkpoint's fingerprint (shard_ckpt_fingerprint) */
    SHARD_AGREE_MODEL, /* a model folder's (shard_weights_fingerprint) */
    SHARD_AGREE_DATA,  /* token files' */
    SHARD_AGREE_INT,   /* a setting: an integer */
    SHARD_AGREE_FLOAT, /* a setting: a float's bits */
    SHARD_AGREE_DTYPE, /* a setting: a shard_dtype (SHARD_DT_INVALID: not given) */
} shard_agree_kind;

typedef struct {
    shard_agree_kind kind;
    const char *name; /* the path (checkpoint, folder, token files), the flag (--seq) */
    uint64_t v;
} shard_agree_item;

shard_agree_item shard_agree_float(const char *name, float x);
/* the items of a layout, inside an array's initializer */
#define SHARD_AGREE_LAYOUT(l)                                                                                   \
    {SHARD_AGREE_INT, "--layout's pp", (uint64_t)(l)->pp}, {SHARD_AGREE_INT, "--layout's tp", (uint64_t)(l)->tp}, \
        {SHARD_AGREE_INT, "--layout's cp", (uint64_t)(l)->cp},                                                  \
        {SHARD_AGREE_INT, "--layout's dp", (uint64_t)(l)->dp}, {SHARD_AGREE_INT, "--layout's ep", (uint64_t)(l)->ep}

/* items[n] (the same names in the same order on every rank) against rank 0's, over c
 * (collective; every rank reaches it, or the run has ended): the first item and rank
 * that differ, as one failure every rank returns alike (SHARD_E_INVALID for an input,
 * SHARD_E_USAGE for a setting), naming both ranks' values. One rank: SHARD_OK. */
shard_status shard_agree_check(shard_comm *c, const shard_agree_item *items, int n);
/* Bytes this rank has sent through c (reset with shard_comm_reset_bytes). */
uint64_t shard_comm_bytes(const shard_comm *c);
void shard_comm_reset_bytes(shard_comm *c);

/* Communicator backends outside libshard (backends/cuda: NCCL, and the CUDA
 * backend's stream-ordered wrapper) fill this table and wrap their state with
 * shard_comm_create; the public calls above check arguments and count bytes, then
 * call the table. */
typedef struct shard_comm_ops {
    const char *name;
    shard_status (*split)(shard_comm *c, int color, int key, shard_comm **out);
    shard_status (*allreduce)(shard_comm *c, void *buf, size_t n, shard_dtype dt, shard_op op);
    shard_status (*reduce_scatter)(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt, shard_op op);
    shard_status (*allgather)(shard_comm *c, const void *send, void *recv, size_t n, shard_dtype dt);
    shard_status (*broadcast)(shard_comm *c, void *buf, size_t n, shard_dtype dt, int root);
    shard_status (*send)(shard_comm *c, const void *buf, size_t n, shard_dtype dt, int peer, int tag);
    shard_status (*recv)(shard_comm *c, void *buf, size_t n, shard_dtype dt, int peer, int tag);
    shard_status (*sendrecv)(shard_comm *c, const void *send, int to, void *recv, int from, size_t n, shard_dtype dt, int tag);
    shard_status (*alltoallv)(shard_comm *c, const void *send, const size_t *scounts, const size_t *sdispls, void *recv,
                              const size_t *rcounts, const size_t *rdispls, shard_dtype dt);
    shard_status (*barrier)(shard_comm *c);
    void (*free)(shard_comm *c); /* the backend's state; the communicator itself is freed by libshard */
    /* optional, both or neither (NULL: sendrecv at start, a wait that does nothing):
     * begin one transfer of shard_comm_sendrecv_start, and end it */
    shard_status (*sendrecv_start)(shard_comm *c, const void *send, int to, void *recv, int from, size_t n, shard_dtype dt, int tag);
    shard_status (*wait)(shard_comm *c);
} shard_comm_ops;
/* A communicator of `size` ranks, this one `rank`, over ops with the backend's state
 * impl (NULL out and SHARD_E_NOMEM when out of memory: impl is then the caller's). */
shard_status shard_comm_create(const shard_comm_ops *ops, int rank, int size, void *impl, shard_comm **out);
void *shard_comm_impl(const shard_comm *c);
/* The backend's name in its table: "self", "mpi", "nccl", "cuda" (the CUDA backend's wrapper). */
const char *shard_comm_backend(const shard_comm *c);

/* NCCL (libshard_nccl.so, built with the CUDA backend from backends/cuda/nccl.c): a communicator over the
 * same processes as `bootstrap` (MPI), one GPU per rank (`device`), buffers in GPU
 * memory; half-precision reductions allowed. Calls wait with a deadline
 * (SMP_NCCL_TIMEOUT seconds, default 300; another value than a number above 0 is
 * refused here, SHARD_E_USAGE) and watch NCCL's asynchronous errors: a failed or hung
 * peer becomes an error on every rank, never a hang. */
shard_status shard_comm_nccl(shard_comm *bootstrap, int device, shard_comm **out);
/* Stream-ordered use (the CUDA backend): from now on c's calls, and those of the
 * communicators split from it, are enqueued on `stream` (a cudaStream_t) and return at
 * once; the work enqueued after them on that stream sees their results. Started
 * transfers (shard_comm_sendrecv_start) run on c's own stream after the work enqueued
 * on `stream` before them, and shard_comm_wait orders the work enqueued after it
 * after the transfer, neither waiting on the host. A barrier still waits. Nothing
 * watches such calls: whoever waits on `stream` must poll shard_comm_nccl_check. */
shard_status shard_comm_nccl_enqueue_on(shard_comm *c, void *stream);
/* NCCL's asynchronous error state of c, for a wait that has lasted waited_s seconds:
 * SHARD_OK, or the failure (an error NCCL reports, waited_s past the deadline
 * SMP_NCCL_TIMEOUT, or an earlier abort), the communicator then aborted. */
shard_status shard_comm_nccl_check(shard_comm *c, double waited_s);
/* Aborts c's NCCL communicator: its calls then fail, naming `why`; on a GPU its
 * pending kernels end. */
void shard_comm_nccl_abort(shard_comm *c, const char *why);
/* This process's rank among the processes of its host, from the launcher's
 * environment (Open MPI, MPICH, SLURM, torchrun's LOCAL_RANK); 0 when unknown. */
int shard_comm_local_rank(void);

/* The groups of a layout, built from a world communicator of layout-size ranks:
 * tp (same pp, dp, cp), cp (same pp, dp, tp), dp (same pp, cp, tp), dpcp (the
 * dp*cp ranks sharing one (pp, tp) position: ZeRO-1's optimizer shards), pp (same
 * dp, cp, tp: the pipeline). */
typedef struct {
    shard_comm *tp, *cp, *dp, *dpcp, *pp;
    shard_coords me;
} shard_groups;
shard_status shard_groups_create(shard_comm *world, const shard_layout *l, shard_groups *out);
void shard_groups_free(shard_groups *g);

#ifdef __cplusplus
}
#endif
#endif /* SHARD_H */
