// Element types a Tensor can hold. The CPU reference computes in F32; the CUDA backend
// adds BF16 compute weights and activations. Token ids are I32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace forge {

enum class DType : uint8_t { F32, BF16, F16, I32, I64, U16, U8 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U16: return 2;
    case DType::U8: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U16: return "u16";
    case DType::U8: return "u8";
  }
  return "?";
}

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::U16; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::U8; }

enum class Device : uint8_t { CPU, CUDA };

constexpr std::string_view device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

}  // namespace forge
