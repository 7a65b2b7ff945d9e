#include "weights.h"

#include <cstring>
#include <iterator>

#include "ggml-cpu.h"

#include "arch.h"
#include "device_weights.h"
#include "errors.h"
#include "field_count.h"

namespace river {

namespace {

std::string shape_str(const int64_t* ne, int n) {
    std::string s = "[";
    for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
    return s + "]";
}


// Look a tensor up and check its shape and type; `required` false returns nullptr when absent.
// `river`: a shape that differs from the backbone's means the river is another model.
ggml_tensor* get(const GgufFile& f, const std::string& name, std::vector<int64_t> shape, WeightUse use, bool required = true,
                 bool river = false) {
    ggml_tensor* t = f.tensor(name);
    if (!t) {
        if (required) throw GgufFormatError("'" + f.path() + "' has no tensor '" + name + "'");
        return nullptr;
    }
    bool ok = ggml_n_dims(t) <= static_cast<int>(shape.size());
    for (size_t i = 0; ok && i < 4; ++i) ok = t->ne[i] == (i < shape.size() ? shape[i] : 1);
    if (!ok) {
        const std::string msg = "tensor '" + name + "' in '" + f.path() + "' has shape " + shape_str(t->ne, ggml_n_dims(t)) +
                                ", expected " + shape_str(shape.data(), static_cast<int>(shape.size()));
        if (river) throw RiverMismatchError(msg);
        throw GgufFormatError(msg);
    }
    check_weight_type(f, t, use);
    return t;
}

LayerWeights load_layer(const GgufFile& f, const HParams& hp, const std::string& prefix, int il, bool river) {
    LayerWeights w;
    hp.arch->load_layer(LayerLoader(f, hp, prefix, il, river), w);
    return w;
}

bool has_prefix(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// The name of some river.* tensor of `f`, or "" when it has none.
std::string any_river_tensor(const GgufFile& f) {
    for (const std::string& name : f.tensor_names()) if (has_prefix(name, "river.")) return name;
    return "";
}

}  // namespace

std::string type_name(ggml_type t) {
    const char* n = ggml_type_name(t);
    return n ? n : "type " + std::to_string(int(t));
}

LayerLoader::LayerLoader(const GgufFile& f, const HParams& hp, const std::string& prefix, int il, bool river)
    : hp(hp),
      e(hp.n_embd),
      q(int64_t(hp.n_head) * hp.head_dim_k),
      k(hp.n_embd_k_gqa()),
      v(hp.n_embd_v_gqa()),
      o(int64_t(hp.n_head) * hp.head_dim_v),
      f_(f),
      p_(prefix + "blk." + std::to_string(il) + "."),
      river_(river) {}

ggml_tensor* LayerLoader::vec(const std::string& name, int64_t len, bool required) const {
    return get(f_, p_ + name, {len}, WeightUse::Vector, required, river_);
}

ggml_tensor* LayerLoader::mat(const std::string& name, int64_t in, int64_t out) const {
    return get(f_, p_ + name, {in, out}, WeightUse::MatMul, true, river_);
}

bool LayerLoader::has(const std::string& name) const { return f_.tensor(p_ + name) != nullptr; }

void LayerLoader::refuse(const std::string& name, const std::string& what) const {
    if (has(name)) {
        throw UnsupportedModelError("'" + f_.path() + "' has '" + p_ + name + "' (" + what +
                                    "), which this engine does not run for " + hp.arch_name);
    }
}

void load_qkvo(const LayerLoader& ld, LayerWeights& w, bool biases_required) {
    ld.refuse("attn_qkv.weight", "a joined Q/K/V weight");
    w.wq = ld.mat("attn_q.weight", ld.e, ld.q);
    w.wk = ld.mat("attn_k.weight", ld.e, ld.k);
    w.wv = ld.mat("attn_v.weight", ld.e, ld.v);
    w.wo = ld.mat("attn_output.weight", ld.o, ld.e);
    load_qkv_biases(ld, w, biases_required);
}

void load_qkv_biases(const LayerLoader& ld, LayerWeights& w, bool required) {
    w.bq = ld.vec("attn_q.bias", ld.q, required);
    w.bk = ld.vec("attn_k.bias", ld.k, required);
    w.bv = ld.vec("attn_v.bias", ld.v, required);
}

void load_llama_layer(const LayerLoader& ld, LayerWeights& w, bool biases_required) {
    w.attn_norm = ld.vec("attn_norm.weight", ld.e);
    load_qkvo(ld, w, biases_required);
    w.ffn_norm = ld.vec("ffn_norm.weight", ld.e);
    load_gated_ffn(ld, w);
}

void load_gated_ffn(const LayerLoader& ld, LayerWeights& w) {
    w.ffn_gate = ld.mat("ffn_gate.weight", ld.e, ld.hp.n_ff);
    w.ffn_up = ld.mat("ffn_up.weight", ld.e, ld.hp.n_ff);
    w.ffn_down = ld.mat("ffn_down.weight", ld.hp.n_ff, ld.e);
}

void refuse_biases_and_experts(const LayerLoader& ld) {
    ld.refuse("attn_output.bias", "an attention output bias");
    for (const char* b : {"ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"}) ld.refuse(b, "an FFN bias");
    ld.refuse("ffn_gate_inp.weight", "a mixture of experts");
}

bool cpu_can_matmul(const ggml_tensor* w) {
    // The CPU device answers yes for any weight type with an F32 input, but its kernels
    // need a dot product for the type (F64 and integer types have none) and a converter
    // for the input's side of it.
    const ggml_type_traits_cpu* tr = ggml_get_type_traits_cpu(w->type);
    if (!tr || !tr->vec_dot) return false;
    if (tr->vec_dot_type != GGML_TYPE_F32 && !ggml_get_type_traits_cpu(tr->vec_dot_type)->from_float) return false;
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    return dev && buft_supports_matmul(dev, ggml_backend_cpu_buffer_type(), w);
}

bool cpu_can_get_rows(const ggml_tensor* w) {
    // The CPU's get_rows reads floats directly and dequantizes the rest row by row; it has
    // no path for F64 or the integer types (I32 rows would be copied as raw bits).
    const ggml_type t = w->type;
    if (t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16) return true;
    return ggml_is_quantized(t) && ggml_get_type_traits(t)->to_float != nullptr;
}

void check_weight_type(const GgufFile& f, const ggml_tensor* t, WeightUse use) {
    auto refuse = [&](const std::string& why) {
        throw GgufFormatError("tensor '" + std::string(ggml_get_name(t)) + "' in '" + f.path() + "' has type " +
                              type_name(t->type) + ", but " + why);
    };
    switch (use) {
        case WeightUse::Vector:
            if (t->type != GGML_TYPE_F32) refuse("1-D tensors must be F32");
            break;
        case WeightUse::TiedTable:
        case WeightUse::Embedding:
            if (!cpu_can_get_rows(t)) refuse("an embedding table must be a float or quantized type");
            if (use == WeightUse::Embedding) break;
            [[fallthrough]];
        case WeightUse::MatMul:
            if (!cpu_can_matmul(t)) refuse("the CPU backend has no matrix multiplication for that type");
            break;
    }
}

BackboneWeights load_backbone(const GgufFile& f, const HParams& hp) {
    // A River GGUF holds its whole river or none of it: a partial one would load as a plain
    // model and silently drop the rest. (A complete one is loaded by load_river.)
    const std::string some = any_river_tensor(f);
    if (!some.empty() && !has_river_layers(f)) {
        throw GgufFormatError("'" + f.path() + "' holds river tensors (e.g. '" + some +
                              "') but not all of them: it has no tensor '" + kRiverMarker + "'");
    }
    // A river index that yields no tensors (e.g. under a format version that has no index)
    // would otherwise leave the file a plain model without a word.
    if (some.empty() && f.has_key("river.tensor_names")) {
        throw GgufFormatError("'" + f.path() + "' has a river index (river.tensor_names) but no river tensors were read "
                              "from it (river.format_version = " + std::to_string(f.get_int("river.format_version", 2)) + ")");
    }
    BackboneWeights w;
    const bool tied = !f.tensor("output.weight");
    w.tok_embd = get(f, "token_embd.weight", {hp.n_embd, hp.n_vocab}, tied ? WeightUse::TiedTable : WeightUse::Embedding);
    w.output_norm = get(f, "output_norm.weight", {hp.n_embd}, WeightUse::Vector);
    w.output = get(f, "output.weight", {hp.n_embd, hp.n_vocab}, WeightUse::MatMul, false);
    if (!w.output) w.output = w.tok_embd;
    // Per-dimension rope factors, where the family reads them (ArchSpec::rope_factors): one set
    // (llama3 scaling), or phi3's LongRoPE sets, chosen by context length (rope_factors).
    // llama.cpp's loaders of the other families ignore both.
    if (hp.arch->rope_factors == RopeFactors::Freqs) {
        w.rope_freqs = get(f, "rope_freqs.weight", {hp.n_rot / 2}, WeightUse::Vector, false);
    }
    if (hp.arch->rope_factors == RopeFactors::LongRope) {
        w.rope_long = get(f, "rope_factors_long.weight", {hp.n_rot / 2}, WeightUse::Vector, false);
        w.rope_short = get(f, "rope_factors_short.weight", {hp.n_rot / 2}, WeightUse::Vector, false);
    }
    for (int il = 0; il < hp.n_layer; ++il) w.layers.push_back(load_layer(f, hp, "", il, false));
    return w;
}

ggml_tensor* BackboneWeights::rope_factors(const HParams& hp, int n_ctx) const {
    if (rope_freqs) return rope_freqs;
    if (!rope_long && !rope_short) return nullptr;
    return GGML_PAD(int64_t(n_ctx), 256) > hp.n_ctx_orig ? rope_long : rope_short;
}

RiverWeights load_river(const GgufFile& f, const HParams& hp, const std::string& prefix) {
    // A river passed as its own file must be a plain GGUF: a River GGUF's own tensors are its
    // F16 backbone, which would then run as the "river".
    if (prefix.empty()) {
        if (const std::string some = any_river_tensor(f); !some.empty()) {
            throw RiverMismatchError("'" + f.path() + "' is a River GGUF (it holds '" + some +
                                     "'); pass a plain GGUF of the same model as the river, or load this file by itself");
        }
    }
    RiverWeights r;
    for (int il = 0; il < hp.n_layer; ++il) r.layers.push_back(load_layer(f, hp, prefix, il, true));
    const bool tied = !f.tensor(prefix + "output.weight");
    // Required: a river's embedding table is part of every river (the converter always writes
    // it), so a River GGUF without it is damaged.
    r.tok_embd = get(f, prefix + "token_embd.weight", {hp.n_embd, hp.n_vocab}, tied ? WeightUse::TiedTable : WeightUse::Embedding,
                     true, true);
    r.head = get(f, prefix + "output.weight", {hp.n_embd, hp.n_vocab}, WeightUse::MatMul, false, true);
    if (!r.head) r.head = r.tok_embd;  // a tied river head is its embedding table
    return r;
}

const std::vector<LayerJoin>& layer_joins() {
    static const std::vector<LayerJoin> joins = {
        {{&LayerWeights::wq, &LayerWeights::wk, &LayerWeights::wv}, {"attn_q", "attn_k", "attn_v"}, &LayerWeights::wqkv, "+k+v"},
        {{&LayerWeights::ffn_gate, &LayerWeights::ffn_up}, {"ffn_gate", "ffn_up"}, &LayerWeights::ffn_gate_up, "+up"},
    };
    return joins;
}

std::vector<std::string> joined_parts(const std::string& name) {
    for (const LayerJoin& j : layer_joins()) {
        const std::string suffix = j.suffix;
        if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
        const std::string first = name.substr(0, name.size() - suffix.size());
        // The first part's name with its kind swapped for each part's: "blk.3.attn_q.weight" -> "blk.3.attn_k.weight".
        const std::string kind0 = std::string(j.kinds[0]) + ".";
        const size_t at = first.rfind(kind0);
        if (at == std::string::npos) continue;
        std::vector<std::string> out;
        for (const char* kind : j.kinds) out.push_back(std::string(first).replace(at, kind0.size(), std::string(kind) + "."));
        return out;
    }
    return {name};
}

const std::vector<SlotKind>& attention_group() {
    static const std::vector<SlotKind> group = {
        {&LayerWeights::attn_norm, "attn_norm"},
        {&LayerWeights::wq, "attn_q"},
        {&LayerWeights::wk, "attn_k"},
        {&LayerWeights::wv, "attn_v"},
        {&LayerWeights::wo, "attn_output"},
        {&LayerWeights::bq, "attn_q"},
        {&LayerWeights::bk, "attn_k"},
        {&LayerWeights::bv, "attn_v"},
        {&LayerWeights::q_norm, "attn_q_norm"},
        {&LayerWeights::k_norm, "attn_k_norm"},
        {&LayerWeights::attn_post_norm, "post_attention_norm"},  // gemma's and olmo2's, on the attention output
        {&LayerWeights::wqkv, "attn_qkv"},                       // phi3's, or joined at load
    };
    return group;
}

namespace {

// Every tensor field of a layer, for placement: a field added to LayerWeights but not here would
// be left behind on the CPU, so the compiler counts the list against the struct (as GraphSpec).
constexpr ggml_tensor* LayerWeights::*kLayerSlots[] = {
    &LayerWeights::attn_norm, &LayerWeights::wq,        &LayerWeights::wk,       &LayerWeights::wv,
    &LayerWeights::wo,        &LayerWeights::bq,        &LayerWeights::bk,       &LayerWeights::bv,
    &LayerWeights::q_norm,    &LayerWeights::k_norm,    &LayerWeights::attn_post_norm,
    &LayerWeights::ffn_norm,  &LayerWeights::ffn_gate,  &LayerWeights::ffn_up,   &LayerWeights::ffn_down,
    &LayerWeights::ffn_post_norm, &LayerWeights::wqkv,  &LayerWeights::ffn_gate_up,
};
static_assert(std::size(kLayerSlots) == field_count<LayerWeights>(), "kLayerSlots must list every field of LayerWeights");

}  // namespace

std::vector<ggml_tensor**> layer_slots(LayerWeights& w) {
    std::vector<ggml_tensor**> out;
    for (auto field : kLayerSlots) out.push_back(&(w.*field));
    return out;
}

std::vector<ggml_tensor**> matmul_slots(LayerWeights& w) {
    std::vector<ggml_tensor**> out;
    for (ggml_tensor** s : {&w.wq, &w.wk, &w.wv, &w.wqkv, &w.wo, &w.ffn_gate, &w.ffn_up, &w.ffn_gate_up, &w.ffn_down}) {
        if (*s) out.push_back(s);
    }
    return out;
}

bool has_river_layers(const GgufFile& f) { return f.tensor(kRiverMarker) != nullptr; }

LayerWeights with_attention_of(const LayerWeights& ffn_from, const LayerWeights& attention_from) {
    LayerWeights w = ffn_from;
    for (const SlotKind& s : attention_group()) w.*s.slot = attention_from.*s.slot;
    return w;
}

}  // namespace river
