// One view of a paged KV cache: addressing and candidate validity for every kernel, CPU included.
#pragma once

#include <cstdint>

#include "formats.h"

namespace jsmla {

// A cache is `num_pages` pages of `page_size` tokens, pages `page_stride` bytes apart. Inline and
// bf16 rows sit `row_stride` bytes apart inside a page; footer pages hold `page_size` data rows
// (`row_stride` == data_row_bytes) followed by `page_size` scale rows. All offsets are 64-bit.
struct CacheView {
  const uint8_t* base = nullptr;
  int64_t num_pages = 0;
  int64_t page_size = 1;
  int64_t page_stride = 0;
  int64_t row_stride = 0;

  JSMLA_HD int64_t num_slots() const { return num_pages * page_size; }
  JSMLA_HD bool contains(int64_t slot) const { return slot >= 0 && slot < num_slots(); }

  // Page of a slot in [0, num_slots()). Slots come from int32 indices and page sizes are below 2^31,
  // so one 32-bit unsigned division suffices (a 64-bit one is a long instruction sequence on GPUs).
  JSMLA_HD int64_t page_of(int64_t slot) const {
    return static_cast<int64_t>(static_cast<uint32_t>(slot) / static_cast<uint32_t>(page_size));
  }

  // Address of the data row of a slot (fp8 values first, then bf16 lanes; or the bf16 row).
  JSMLA_HD const uint8_t* data_row(int64_t slot) const {
    const int64_t page = page_of(slot);
    const int64_t row = slot - page * page_size;
    return base + page * page_stride + row * row_stride;
  }

  // Address of the first scale of a slot.
  JSMLA_HD const uint8_t* scales(const FormatTraits& f, int64_t slot) const {
    if (f.layout != Layout::kFooter) return data_row(slot) + f.scale_offset;
    const int64_t page = page_of(slot);
    const int64_t row = slot - page * page_size;
    return base + page * page_stride + page_size * row_stride + row * f.scale_row_bytes;
  }
};

// One list of candidates per query row: global slots into `cache`, a cache of format `format` (the extra
// list of a dual cache may use another format of the same widths).
struct CandidateList {
  CacheView cache;
  FormatId format = FormatId::kDsv32;
  const int32_t* indices = nullptr;     // [num_tokens, topk]
  int32_t topk = 0;                     // row width; 0 when the list is absent
  const int32_t* topk_length = nullptr; // [num_tokens] or nullptr (= topk)
  int32_t max_candidates = 0;           // format window (0 = none)

  // Number of leading positions of row t that may hold valid candidates.
  JSMLA_HD int32_t row_length(int64_t t) const {
    int32_t n = topk;
    if (topk_length != nullptr) {
      const int32_t requested = topk_length[t];
      n = requested < 0 ? 0 : (requested < topk ? requested : topk);
    }
    if (max_candidates > 0 && n > max_candidates) n = max_candidates;
    return n;
  }

  // Slot of candidate j of row t, or -1 when it is masked (j must be < row_length(t)).
  JSMLA_HD int64_t slot(int64_t t, int32_t j) const {
    const int64_t s = indices[t * static_cast<int64_t>(topk) + j];
    return cache.contains(s) ? s : -1;
  }
};

}  // namespace jsmla
