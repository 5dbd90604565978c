// expect_error: runs an action that must throw forge::Error whose message holds every
// fragment (the file, key or offset a user-facing error has to name); error_of: the
// message itself, for tests that compare it whole.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "core/error.h"

namespace forge {

inline void expect_error(const std::function<void()>& action, const std::vector<std::string>& fragments) {
  try {
    action();
    FAIL() << "expected an error containing " << fragments.front();
  } catch (const Error& e) {
    for (const auto& fragment : fragments)
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what() << "\nlacks: " << fragment;
  }
}

// The message of the forge::Error `action` throws, or "" when it throws none.
inline std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace forge
