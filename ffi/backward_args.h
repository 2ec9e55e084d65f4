// Buffer/attribute decoding and checks of the backward target (target_name.h): the forward's operands
// (decoded as in attention_args.h), the forward's lse and out, the cotangents of out and lse, and the
// gradients.
// A zero cotangent and a gradient that is not wanted are passed as empty buffers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "ffi/attention_args.h"
#include "kernels/common/backward_params.h"

namespace jsmla::ffi_glue {

// Decodes every operand and result of a backward call into `params` and checks what the kernels rely on.
inline ffi::Error decode_backward(int32_t kv_format, int32_t extra_kv_format, float sm_scale,
                                  const CacheGeometry& main_geometry, const CacheGeometry& extra_geometry,
                                  ffi::Buffer<ffi::BF16> q,
                                  ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> indices,
                                  ffi::Buffer<ffi::S32> topk_length, ffi::Buffer<ffi::F32> attn_sink,
                                  ffi::AnyBuffer extra_kv_cache, ffi::Buffer<ffi::S32> extra_indices,
                                  ffi::Buffer<ffi::S32> extra_topk_length, ffi::Buffer<ffi::S32> valid_tokens,
                                  ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::BF16> out, ffi::Buffer<ffi::BF16> d_out,
                                  ffi::Buffer<ffi::F32> d_lse, ffi::Result<ffi::Buffer<ffi::BF16>> d_q,
                                  ffi::Result<ffi::Buffer<ffi::BF16>> d_kv_cache,
                                  ffi::Result<ffi::Buffer<ffi::F32>> d_attn_sink, int64_t gradient_groups,
                                  int64_t chunk_tokens,
                                  const FormatTraits** format, BackwardParams* params) {
  AttentionParams& forward = params->forward;
  if (auto error = decode_operands(kv_format, extra_kv_format, sm_scale, main_geometry, extra_geometry, q,
                                   kv_cache, indices, topk_length, attn_sink, extra_kv_cache, extra_indices,
                                   extra_topk_length, valid_tokens, format, &forward);
      error.failure()) {
    return error;
  }
  const FormatTraits& f = **format;
  const int64_t rows = forward.num_tokens * forward.num_heads;
  const std::string shape = "[" + std::to_string(forward.num_tokens) + ", " + std::to_string(forward.num_heads);
  auto count_is = [](size_t count, int64_t expected) { return static_cast<int64_t>(count) == expected; };
  if (!count_is(lse.element_count(), rows)) {
    return ffi::Error::InvalidArgument("lse: expected " + shape + "], got " + dims_text(lse.dimensions()));
  }
  if (!count_is(out.element_count(), rows * f.d_v)) {
    return ffi::Error::InvalidArgument("out: expected " + shape + ", " + std::to_string(f.d_v) + "], got " +
                                       dims_text(out.dimensions()));
  }
  if (d_out.element_count() != 0 && !count_is(d_out.element_count(), rows * f.d_v)) {
    return ffi::Error::InvalidArgument("d_out: expected " + shape + ", " + std::to_string(f.d_v) +
                                       "] or empty, got " + dims_text(d_out.dimensions()));
  }
  if (d_lse.element_count() != 0 && !count_is(d_lse.element_count(), rows)) {
    return ffi::Error::InvalidArgument("d_lse: expected " + shape + "] or empty, got " +
                                       dims_text(d_lse.dimensions()));
  }
  if (d_q->element_count() != 0 && !count_is(d_q->element_count(), rows * f.d_qk)) {
    return ffi::Error::InvalidArgument("d_q: expected " + shape + ", " + std::to_string(f.d_qk) +
                                       "] or empty, got " + dims_text(d_q->dimensions()));
  }
  if (gradient_groups < 1 || forward.num_tokens % gradient_groups != 0) {
    return ffi::Error::InvalidArgument("gradient_groups: expected a divisor of T = " +
                                       std::to_string(forward.num_tokens) + ", got " + std::to_string(gradient_groups));
  }
  if (d_kv_cache->element_count() != 0) {
    // The cache gradient is written as dense bf16 rows, which every accepted bf16 cache shape is.
    const CacheView& cache = forward.main.cache;
    const bool dense_rows = cache.row_stride == 2 * f.d_qk && cache.page_stride == cache.page_size * cache.row_stride;
    if (f.layout != Layout::kBf16 || !dense_rows ||
        !count_is(d_kv_cache->element_count(), gradient_groups * cache.num_slots() * f.d_qk)) {
      return ffi::Error::InvalidArgument(
          "d_kv_cache: expected empty, or for a bf16 format " + std::to_string(gradient_groups) +
          " gradient(s) of the cache's " + std::to_string(cache.num_slots()) + " x " + std::to_string(f.d_qk) +
          " dense rows, got " + dims_text(d_kv_cache->dimensions()) + " for kv_format " + std::to_string(kv_format) +
          " and geometry " + geometry_text(main_geometry));
    }
  }
  if (d_attn_sink->element_count() != 0 &&
      (forward.attn_sink == nullptr ||
       !count_is(d_attn_sink->element_count(), gradient_groups * forward.num_heads))) {
    return ffi::Error::InvalidArgument("d_attn_sink: expected empty, or [" + std::to_string(gradient_groups) + ", " +
                                       std::to_string(forward.num_heads) + "] with attn_sink given, got " +
                                       dims_text(d_attn_sink->dimensions()));
  }
  if (d_kv_cache->element_count() != 0 && (chunk_tokens < 1 || chunk_tokens > std::max<int64_t>(forward.num_tokens, 1))) {
    return ffi::Error::InvalidArgument("chunk_tokens: expected 1 to T = " + std::to_string(forward.num_tokens) +
                                       " with a cache gradient, got " + std::to_string(chunk_tokens));
  }
  params->gradient_groups = gradient_groups;
  params->chunk_tokens = chunk_tokens;
  params->lse = lse.typed_data();
  params->out = reinterpret_cast<const uint16_t*>(out.typed_data());
  params->d_out = d_out.element_count() ? reinterpret_cast<const uint16_t*>(d_out.typed_data()) : nullptr;
  params->d_lse = d_lse.element_count() ? d_lse.typed_data() : nullptr;
  params->d_q = d_q->element_count() ? reinterpret_cast<uint16_t*>(d_q->typed_data()) : nullptr;
  params->d_kv_cache = d_kv_cache->element_count() ? reinterpret_cast<uint16_t*>(d_kv_cache->typed_data()) : nullptr;
  params->d_attn_sink = d_attn_sink->element_count() ? d_attn_sink->typed_data() : nullptr;
  return ffi::Error::Success();
}

// The backward target's binding: the forward's operands, then lse, out, d_out and d_lse; the three gradients;
// the forward's format and geometry attributes (the backward has no plan) and the gradient groups.
template <typename Binding>
auto bind_backward(Binding&& binding) {
  return bind_cache_attributes(bind_operands(std::forward<Binding>(binding))
                                   .template Arg<ffi::Buffer<ffi::F32>>()    // lse ([T, H], the forward's)
                                   .template Arg<ffi::Buffer<ffi::BF16>>()   // out ([T, H, d_v], the forward's)
                                   .template Arg<ffi::Buffer<ffi::BF16>>()   // d_out ([T, H, d_v] or [0])
                                   .template Arg<ffi::Buffer<ffi::F32>>()    // d_lse ([T, H] or [0])
                                   .template Ret<ffi::Buffer<ffi::BF16>>()   // d_q ([T, H, d_qk] or [0])
                                   .template Ret<ffi::Buffer<ffi::BF16>>()   // d_kv_cache ([G, *the cache's shape] or [0])
                                   .template Ret<ffi::Buffer<ffi::F32>>())   // d_attn_sink ([G, H] or [0])
      .template Attr<int64_t>("gradient_groups")   // G: one cache and sink gradient per T / G rows
      .template Attr<int64_t>("chunk_tokens");     // tokens per chunk of the CUDA cache gradient
}

}  // namespace jsmla::ffi_glue
