#pragma once

#include <cstdint>

#include "kernels/cpu/fp8.h"
#include "kernels/cuda/fp8_grouped_layout.h"
#include "kernels/cuda/types.h"

namespace forge::cuda {

using cpu::Fp8Format;

// The row groups of a row-major bf16 matrix [rows, cols] that the grouped casts quantize
// each with its own scale (NOTE [FP8 grouped expert casts] in kernels/cuda/fp8_grouped_cast.cu):
// group g is rows [offsets[g], offsets[g + 1]) with `offsets` (I64, groups + 1) on the
// device, or, with offsets null, rows [g * rows_per_group, (g + 1) * rows_per_group) (an
// expert stack [E, out, in] as E groups of `out` rows). `max_rows`: at least the largest
// group's rows (the host's copy of the offsets says it), which sizes the grid.
struct Fp8RowGroups {
  const int64_t* offsets = nullptr;
  int64_t groups = 0;
  int64_t cols = 0;
  int64_t max_rows = 0;
  int64_t rows_per_group = 0;  // with offsets null
};

// Group g's statistics at base + g * stride (floats): an Fp8ForwardStats slot per expert,
// or the role's entry of each expert's statistics block. A null base: none.
struct Fp8GroupStats {
  float* base = nullptr;
  int64_t stride = 0;
};

// amax[g] = max |x| over group g's rows (NaN if one is NaN, 0 for none), as fp8_amax on
// each group's rows. Empty groups' slots are left as they are.
void fp8_grouped_amax(const bf16* x, const Fp8RowGroups& groups, Fp8GroupStats amax);

// For each non-empty group, fp8_scale_from_amax(amax[g], format, false, scale[g],
// scale_inv[g], seen[g]) (seen may have a null base).
void fp8_grouped_scale_from_amax(const Fp8RowGroups& groups, Fp8GroupStats amax, Fp8Format format,
                                 Fp8GroupStats scale, Fp8GroupStats scale_inv, Fp8GroupStats seen);

// out[i] = the code of x[i] with its group's scale, group g's codes row-major at out +
// fp8_grouped_codes_at(offsets[g], cols, g), as fp8_cast on each group's rows; with an amax base, each
// group's max |x| folded into amax[g] (delayed scaling's `seen`).
void fp8_grouped_cast(const bf16* x, const Fp8RowGroups& groups, Fp8GroupStats scale, Fp8Format format,
                      uint8_t* out, Fp8GroupStats amax);

}  // namespace forge::cuda
