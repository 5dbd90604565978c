// Object .npy files of records, as numpy.save writes a list of dicts: the layout of the
// MLPerf Llama 2 70B LoRA data (train.npy / validation.npy, data/govreport_dataset.h).
//
// NOTE [Pickled records without a Python]
// numpy.save stores an array of dtype '|O' as a pickle of the ndarray (NOTE [The .npy
// format] in npy_array.h). forge never runs a pickle: it decodes the opcodes Python's
// pickler emits for numpy.save (protocol 3 in numpy 1, 4 in numpy 2: FRAME, MARK, tuples,
// lists, dicts, ints, strings, bytes, the memo) into inert values, and the only
// REDUCE/BUILD it evaluates are the three
// globals an ndarray's pickle names: numpy.core.multiarray._reconstruct (numpy._core in
// numpy 2), numpy.ndarray and numpy.dtype, building an array from its (version, shape,
// dtype, fortran_order, data) state. Any other global or opcode is an error naming the
// file, the byte offset and the opcode. The result must be a 1-d object array of dicts
// with str keys whose values are 1-d integer arrays (C order) or lists of ints; the pickle
// must end exactly at the end of the file.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace forge {

// One record: each key's integer values, in order.
using NpyRecord = std::map<std::string, std::vector<int64_t>>;

// Decodes `path` and calls visit(index, record) for its records in order; returns their
// count. Errors (a forge::Error) name the file and, where it applies, the byte offset or
// the record.
int64_t read_npy_records(const std::string& path, const std::function<void(int64_t, const NpyRecord&)>& visit);

}  // namespace forge
