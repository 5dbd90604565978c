// Token embedding lookup: out[n, :] = table[tokens[n], :], tokens int32 [N], table [V, H].
// The backward ACCUMULATES rows into dtable (dtable[tokens[n]] += dout[n]) in a fixed
// order, so repeated tokens sum deterministically.
#pragma once

#include "core/tensor.h"

namespace forge {

void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table);
void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens);

}  // namespace forge
