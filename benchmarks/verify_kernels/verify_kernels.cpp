// What a verify batch of B tokens costs in ggml's CPU mat-mul kernels, against one token, and which
// kernel gives each column the bits of a single-token step.
//
//   cmake -S benchmarks/verify_kernels -B build/verify_kernels -DPython_EXECUTABLE=$PWD/.venv/bin/python
//   cmake --build build/verify_kernels
//   build/verify_kernels/verify_kernels [K M THREADS REPS TYPE]     # default 896 151936 2 10 f16
//
// W is a K x M weight of TYPE (f16 or bf16; 896 x 151,936 is Qwen2.5-Coder-0.5B's head, 272 MB, far
// past the caches, so a single column reads it from memory), X a K x B activation. Two ways to
// multiply B columns:
// - plain: X as F32, contiguous: the CPU backend hands B >= 2 to llamafile's tinyBLAS and one column
//   to ggml_vec_dot_* (what a verify batch and a decode step run today);
// - strided: X cast to W's type with its rows padded, so not contiguous: tinyBLAS is skipped and
//   ggml's own blocked gemm runs ggml_vec_dot_* on every (row, column), the single-token kernel.
// For each B the median time of REPS runs, its ratio to one column, and how many outputs of the
// batch's first column differ in their bits from the same column multiplied alone. Run it alone.
#include <ggml.h>
#include <ggml-cpu.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

struct Setup {
    int k = 896, m = 151936, threads = 2, reps = 10;
    ggml_type type = GGML_TYPE_F16;
};

// X [K, B] F32 -> the weight's type with rows padded by 32 elements: a view that is not contiguous.
ggml_tensor* strided_activation(ggml_context* ctx, ggml_tensor* x, ggml_type type) {
    ggml_tensor* cast = ggml_cast(ctx, ggml_pad(ctx, x, 32, 0, 0, 0), type);
    return ggml_view_2d(ctx, cast, x->ne[0], x->ne[1], cast->nb[1], 0);
}

struct Timing {
    double ms;
    std::vector<float> out;
};

Timing multiply(const Setup& s, ggml_tensor* w, const std::vector<float>& x_data, int b, bool strided,
                ggml_threadpool* pool) {
    ggml_init_params params{size_t(64) << 20 | (size_t(s.m) * b * 8), nullptr, false};
    ggml_context* ctx = ggml_init(params);
    ggml_tensor* x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, s.k, b);
    std::memcpy(x->data, x_data.data(), sizeof(float) * size_t(s.k) * b);
    ggml_tensor* y = ggml_mul_mat(ctx, w, strided ? strided_activation(ctx, x, s.type) : x);
    ggml_cgraph* graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, y);
    ggml_cplan plan = ggml_graph_plan(graph, s.threads, pool);
    std::vector<uint8_t> work(plan.work_size + 1);
    plan.work_data = work.data();
    std::vector<double> times;
    for (int r = 0; r < s.reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        ggml_graph_compute(graph, &plan);
        times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    Timing t{times[times.size() / 2], std::vector<float>((float*)y->data, (float*)y->data + size_t(s.m) * b)};
    ggml_free(ctx);
    return t;
}

size_t differing_bits(const std::vector<float>& a, const std::vector<float>& b, int m) {
    size_t n = 0;
    for (int i = 0; i < m; ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return n;
}

}  // namespace

int main(int argc, char** argv) {
    Setup s;
    if (argc > 1) s.k = std::atoi(argv[1]);
    if (argc > 2) s.m = std::atoi(argv[2]);
    if (argc > 3) s.threads = std::atoi(argv[3]);
    if (argc > 4) s.reps = std::atoi(argv[4]);
    if (argc > 5) {
        const std::string t = argv[5];
        if (t != "f16" && t != "bf16") {
            std::fprintf(stderr, "TYPE must be f16 or bf16, not %s\n", argv[5]);
            return 2;
        }
        s.type = t == "bf16" ? GGML_TYPE_BF16 : GGML_TYPE_F16;
    }
    if (s.k <= 0 || s.k % 32 || s.m <= 0 || s.threads <= 0 || s.reps <= 0) {
        std::fprintf(stderr, "K (a multiple of 32), M, THREADS and REPS must be positive\n");
        return 2;
    }
    const int max_b = 9;
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    ggml_init_params wparams{size_t(s.k) * s.m * 2 + (size_t(1) << 20), nullptr, false};
    ggml_context* wctx = ggml_init(wparams);
    ggml_tensor* w = ggml_new_tensor_2d(wctx, s.type, s.k, s.m);
    std::vector<float> row(s.k);
    for (int r = 0; r < s.m; ++r) {
        for (float& v : row) v = 0.05f * normal(rng);
        char* dst = (char*)w->data + size_t(r) * w->nb[1];
        if (s.type == GGML_TYPE_F16) ggml_fp32_to_fp16_row(row.data(), (ggml_fp16_t*)dst, s.k);
        else ggml_fp32_to_bf16_row(row.data(), (ggml_bf16_t*)dst, s.k);
    }
    std::vector<float> x(size_t(s.k) * max_b);
    for (float& v : x) v = normal(rng);
    ggml_threadpool_params tpp = ggml_threadpool_params_default(s.threads);
    ggml_threadpool* pool = ggml_threadpool_new(&tpp);

    const Timing one = multiply(s, w, x, 1, false, pool);
    std::printf("W %s %d x %d, %d threads, median of %d\n", ggml_type_name(s.type), s.k, s.m, s.threads, s.reps);
    std::printf("| B | plain ms | x B=1 | strided ms | x B=1 | first column's outputs with other bits: plain | strided |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|\n");
    std::printf("| 1 | %.2f | 1.00 | - | - | - | - |\n", one.ms);
    for (int b : {2, 3, 4, 5, 6, 8, 9}) {
        const Timing plain = multiply(s, w, x, b, false, pool);
        const Timing strided = multiply(s, w, x, b, true, pool);
        std::printf("| %d | %.2f | %.2f | %.2f | %.2f | %zu of %d | %zu of %d |\n", b, plain.ms, plain.ms / one.ms,
                    strided.ms, strided.ms / one.ms, differing_bits(plain.out, one.out, s.m), s.m,
                    differing_bits(strided.out, one.out, s.m), s.m);
    }
    ggml_threadpool_free(pool);
    ggml_free(wctx);
    return 0;
}
