// Buffer/attribute decoding and checks shared by the CPU and CUDA handlers. Both targets bind exactly
// the same operands and attributes (the contract of the versioned target name in target_name.h); the
// backward target (backward_args.h) reuses the operand decoding.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "kernels/common/contract.h"
#include "kernels/common/params.h"
// nvcc's front end flags the XLA FFI headers (exhaustive switches without a trailing return,
// always_inline on non-inline functions); they are fine under the host compilers XLA supports.
#ifdef __NVCC__
#pragma nv_diag_suppress 940
#pragma nv_diag_suppress 2473
#endif
#include "xla/ffi/api/ffi.h"
#ifdef __NVCC__
#pragma nv_diag_default 940
#pragma nv_diag_default 2473
#endif

namespace jsmla::ffi_glue {

namespace ffi = xla::ffi;

struct CacheGeometry {
  int64_t page_size, num_pages, page_stride, row_stride;
};

inline std::string geometry_text(const CacheGeometry& g) {
  return "page_size=" + std::to_string(g.page_size) + " num_pages=" + std::to_string(g.num_pages) +
         " page_stride=" + std::to_string(g.page_stride) + " row_stride=" + std::to_string(g.row_stride);
}

// Checks that the geometry addresses only bytes of `cache` and fills `view`.
inline ffi::Error make_view(const FormatTraits& f, const char* name, ffi::AnyBuffer cache,
                            const CacheGeometry& g, CacheView* view) {
  const int64_t size = static_cast<int64_t>(cache.size_bytes());
  const bool footer = f.layout == Layout::kFooter;
  bool ok = g.page_size >= 1 && g.num_pages >= 0 && g.row_stride >= f.data_row_bytes &&
            (!footer || g.row_stride == f.data_row_bytes);
  if (ok && g.num_pages > 0) {
    const int64_t page_extent = footer ? g.page_size * (g.row_stride + f.scale_row_bytes)
                                       : (g.page_size - 1) * g.row_stride + f.data_row_bytes;
    ok = g.page_stride >= page_extent && (g.num_pages - 1) * g.page_stride + page_extent <= size;
  }
  if (!ok) {
    return ffi::Error::InvalidArgument(std::string(name) + ": geometry " + geometry_text(g) +
                                       " does not fit a buffer of " + std::to_string(size) + " bytes");
  }
  view->base = static_cast<const uint8_t*>(cache.untyped_data());
  view->num_pages = g.num_pages;
  view->page_size = g.page_size;
  view->page_stride = g.page_stride;
  view->row_stride = g.row_stride;
  return ffi::Error::Success();
}

inline std::string dims_text(ffi::AnyBuffer::Dimensions dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

// Decodes the operands of the attention (everything but its results) into `params` and checks what the
// kernels rely on. The backward target (backward_args.h) takes the same operands.
inline ffi::Error decode_operands(int32_t kv_format, int32_t extra_kv_format, float sm_scale,
                                  const CacheGeometry& main_geometry, const CacheGeometry& extra_geometry,
                                  ffi::Buffer<ffi::BF16> q, ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> indices,
                                  ffi::Buffer<ffi::S32> topk_length, ffi::Buffer<ffi::F32> attn_sink,
                                  ffi::AnyBuffer extra_kv_cache, ffi::Buffer<ffi::S32> extra_indices,
                                  ffi::Buffer<ffi::S32> extra_topk_length, ffi::Buffer<ffi::S32> valid_tokens,
                                  const FormatTraits** format, AttentionParams* params) {
  if (kv_format < 0 || kv_format >= kNumFormats) {
    return ffi::Error::InvalidArgument("kv_format: unknown format id " + std::to_string(kv_format));
  }
  const FormatTraits& f = kFormatTable[kv_format];
  *format = &f;
  const auto q_dims = q.dimensions();
  if (q_dims.size() != 3 || q_dims[2] != f.d_qk || q_dims[1] < kMinHeads || q_dims[1] > kMaxHeads) {
    return ffi::Error::InvalidArgument("q: expected [T, H, " + std::to_string(f.d_qk) + "] with " +
                                       std::to_string(kMinHeads) + " <= H <= " + std::to_string(kMaxHeads) +
                                       ", got " + dims_text(q_dims));
  }
  const int64_t num_tokens = q_dims[0];
  const int64_t num_heads = q_dims[1];
  const auto index_dims = indices.dimensions();
  if (index_dims.size() != 2 || index_dims[0] != num_tokens || index_dims[1] < kMinTopk) {
    return ffi::Error::InvalidArgument("indices: expected [" + std::to_string(num_tokens) + ", topk >= " +
                                       std::to_string(kMinTopk) + "], got " + dims_text(index_dims));
  }
  const auto extra_dims = extra_indices.dimensions();
  if (extra_dims.size() != 2 || extra_dims[0] != num_tokens) {
    return ffi::Error::InvalidArgument("extra_indices: expected [" + std::to_string(num_tokens) +
                                       ", extra_topk], got " + dims_text(extra_dims));
  }
  const bool has_extra = extra_dims[1] > 0;
  if (has_extra && !f.dual_cache) {
    return ffi::Error::InvalidArgument("extra_kv_cache: this format has no dual-cache form");
  }
  if (extra_kv_format < 0 || extra_kv_format >= kNumFormats) {
    return ffi::Error::InvalidArgument("extra_kv_format: unknown format id " + std::to_string(extra_kv_format));
  }
  const FormatTraits& extra_f = kFormatTable[extra_kv_format];
  if (has_extra && (!extra_f.dual_cache || extra_f.d_qk != f.d_qk || extra_f.d_v != f.d_v)) {
    return ffi::Error::InvalidArgument("extra_kv_format: format " + std::to_string(extra_kv_format) +
                                       " cannot be the extra cache of format " + std::to_string(kv_format) +
                                       " (a dual-cache format of the same d_qk and d_v)");
  }
  auto count_ok = [](size_t count, int64_t expected) {
    return count == 0 || static_cast<int64_t>(count) == expected;
  };
  if (!count_ok(topk_length.element_count(), num_tokens) ||
      !count_ok(extra_topk_length.element_count(), num_tokens)) {
    return ffi::Error::InvalidArgument("topk_length/extra_topk_length: expected [T] or empty");
  }
  if (!count_ok(attn_sink.element_count(), num_heads)) {
    return ffi::Error::InvalidArgument("attn_sink: expected [H] or empty");
  }
  if (valid_tokens.element_count() > 1) {
    return ffi::Error::InvalidArgument("valid_tokens: expected [1] or empty");
  }

  AttentionParams& p = *params;
  p.q = reinterpret_cast<const uint16_t*>(q.typed_data());
  p.num_tokens = num_tokens;
  p.num_heads = static_cast<int32_t>(num_heads);
  p.sm_scale = sm_scale;
  p.main.indices = indices.typed_data();
  p.main.topk = static_cast<int32_t>(index_dims[1]);
  p.main.topk_length = topk_length.element_count() ? topk_length.typed_data() : nullptr;
  p.main.max_candidates = f.max_candidates;
  p.main.format = f.id;
  if (auto error = make_view(f, "kv_cache", kv_cache, main_geometry, &p.main.cache); error.failure()) return error;
  p.extra = CandidateList{};
  if (has_extra) {
    p.extra.indices = extra_indices.typed_data();
    p.extra.topk = static_cast<int32_t>(extra_dims[1]);
    p.extra.topk_length = extra_topk_length.element_count() ? extra_topk_length.typed_data() : nullptr;
    p.extra.max_candidates = extra_f.max_candidates;
    p.extra.format = extra_f.id;
    if (auto error = make_view(extra_f, "extra_kv_cache", extra_kv_cache, extra_geometry, &p.extra.cache);
        error.failure()) {
      return error;
    }
  }
  p.attn_sink = attn_sink.element_count() ? attn_sink.typed_data() : nullptr;
  // Empty: every row is valid, and the kernels read no count (one dependent load less before a block's
  // first gather).
  p.valid_tokens = valid_tokens.element_count() ? valid_tokens.typed_data() : nullptr;
  return ffi::Error::Success();
}

// Decodes every operand and result of the forward call into `params` and checks what the kernels rely on.
inline ffi::Error decode_attention(int32_t kv_format, int32_t extra_kv_format, float sm_scale,
                                   const CacheGeometry& main_geometry,
                                   const CacheGeometry& extra_geometry, ffi::Buffer<ffi::BF16> q,
                                   ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> indices,
                                   ffi::Buffer<ffi::S32> topk_length, ffi::Buffer<ffi::F32> attn_sink,
                                   ffi::AnyBuffer extra_kv_cache, ffi::Buffer<ffi::S32> extra_indices,
                                   ffi::Buffer<ffi::S32> extra_topk_length, ffi::Buffer<ffi::S32> valid_tokens,
                                   ffi::Result<ffi::Buffer<ffi::BF16>> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                   const FormatTraits** format, AttentionParams* params) {
  if (auto error = decode_operands(kv_format, extra_kv_format, sm_scale, main_geometry, extra_geometry, q,
                                   kv_cache, indices, topk_length, attn_sink, extra_kv_cache, extra_indices,
                                   extra_topk_length, valid_tokens, format, params);
      error.failure()) {
    return error;
  }
  const auto out_dims = out->dimensions();
  const auto lse_dims = lse->dimensions();
  const int64_t num_tokens = params->num_tokens;
  const int64_t num_heads = params->num_heads;
  if (out_dims.size() != 3 || out_dims[0] != num_tokens || out_dims[1] != num_heads ||
      out_dims[2] != (*format)->d_v || lse_dims.size() != 2 || lse_dims[0] != num_tokens ||
      lse_dims[1] != num_heads) {
    return ffi::Error::InvalidArgument("out/lse: result shapes do not match q and the format");
  }
  params->out = reinterpret_cast<uint16_t*>(out->typed_data());
  params->lse = lse->typed_data();
  return ffi::Error::Success();
}

// Adds the call's operands to a binding (after any context arguments): the forward's and the backward's.
template <typename Binding>
auto bind_operands(Binding&& binding) {
  return std::move(binding).template Arg<ffi::Buffer<ffi::BF16>>()  // q
      .template Arg<ffi::AnyBuffer>()                      // kv_cache
      .template Arg<ffi::Buffer<ffi::S32>>()               // indices
      .template Arg<ffi::Buffer<ffi::S32>>()               // topk_length ([T] or [0])
      .template Arg<ffi::Buffer<ffi::F32>>()               // attn_sink ([H] or [0])
      .template Arg<ffi::AnyBuffer>()                      // extra_kv_cache
      .template Arg<ffi::Buffer<ffi::S32>>()               // extra_indices ([T, extra_topk])
      .template Arg<ffi::Buffer<ffi::S32>>()               // extra_topk_length ([T] or [0])
      .template Arg<ffi::Buffer<ffi::S32>>();              // valid_tokens ([1])
}

// Adds the formats, the softmax scale and both caches' geometry attributes (after the results).
template <typename Binding>
auto bind_cache_attributes(Binding&& binding) {
  return std::move(binding).template Attr<int32_t>("kv_format")
      .template Attr<int32_t>("extra_kv_format")
      .template Attr<float>("sm_scale")
      .template Attr<int64_t>("page_size")
      .template Attr<int64_t>("num_pages")
      .template Attr<int64_t>("page_stride")
      .template Attr<int64_t>("row_stride")
      .template Attr<int64_t>("extra_page_size")
      .template Attr<int64_t>("extra_num_pages")
      .template Attr<int64_t>("extra_page_stride")
      .template Attr<int64_t>("extra_row_stride");
}

// The forward target's binding: the operands, out/lse/workspace, the cache attributes and the plan.
template <typename Binding>
auto bind_attention(Binding&& binding) {
  return bind_cache_attributes(bind_operands(std::forward<Binding>(binding))
                                   .template Ret<ffi::Buffer<ffi::BF16>>()   // out
                                   .template Ret<ffi::Buffer<ffi::F32>>()    // lse
                                   .template Ret<ffi::Buffer<ffi::U8>>())    // workspace
      .template Attr<int32_t>("variant")
      .template Attr<int32_t>("num_splits")
      .template Attr<int32_t>("split_size")
      .template Attr<int32_t>("heads_per_block");
}

}  // namespace jsmla::ffi_glue
