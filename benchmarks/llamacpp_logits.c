/* Teacher-forced logits of a llama.cpp GGUF text model, for bench_llamacpp.py --quality:
 * the tokens of TOKENS (int32, native order) fed one llama_decode call each, in llama.cpp's
 * default context configuration, and after each the logits of the next token appended to
 * OUT (float32 [tokens, vocab]). REPACK 0:
 * quantized weights not repacked for this CPU (llama.cpp's --no-repack), else its default.
 * Built by bench_llamacpp.py against the libllama it builds; the runtime never uses it. */
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s MODEL.gguf TOKENS.i32 OUT.f32 THREADS REPACK\n", argv[0]);
        return 2;
    }
    FILE *in = fopen(argv[2], "rb");
    if (!in) { perror(argv[2]); return 1; }
    fseek(in, 0, SEEK_END);
    long n = ftell(in) / (long)sizeof(llama_token);
    rewind(in);
    llama_token *tokens = malloc(n * sizeof(llama_token));
    if (fread(tokens, sizeof(llama_token), n, in) != (size_t)n) { fprintf(stderr, "short read: %s\n", argv[2]); return 1; }
    fclose(in);

    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = atoi(argv[5]) != 0;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)n;
    cp.n_threads = cp.n_threads_batch = atoi(argv[4]);
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot make a context\n"); return 1; }
    int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    FILE *out = fopen(argv[3], "wb");
    if (!out) { perror(argv[3]); return 1; }
    for (long i = 0; i < n; i++) {
        if (llama_decode(ctx, llama_batch_get_one(&tokens[i], 1))) {
            fprintf(stderr, "llama_decode failed at token %ld\n", i);
            return 1;
        }
        fwrite(llama_get_logits_ith(ctx, -1), sizeof(float), vocab, out);
    }
    fclose(out);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(tokens);
    return 0;
}
