// US_CHECK(cond, parts...): TORCH_CHECK with its message built without iostreams.
//
// Why: on the GPU machine (Ubuntu 24.04, torch 2.11+cu130; 2026-11-26) the extension as built there defined its
// own copies of libstdc++'s stream and locale code (`std::ostream::_M_insert<long>`, `std::codecvt` members), and
// the first TORCH_CHECK message that printed an integer crashed inside that copy: a segfault instead of the
// RuntimeError (the native frames are in docs/gpu.md). TORCH_CHECK formats its arguments with an
// std::ostringstream instantiated in the caller's library; given one std::string it uses that string as it is
// (c10/util/StringUtil.h, _str_wrapper<std::string>). So every check here builds its message as a string with
// std::to_string and appends, and hands TORCH_CHECK that one string. Only on failure: TORCH_CHECK evaluates its
// message lazily.

#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace unifiedserve {
namespace detail {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>,
                                       int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  s += buf;
}
inline void append(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, c10::DeviceType v) { s += c10::DeviceTypeName(v, /*lower_case=*/true); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }  // formatted inside libc10

}  // namespace detail

template <typename... Args>
std::string check_msg(const Args&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

}  // namespace unifiedserve

#define US_CHECK(cond, ...) TORCH_CHECK(cond, ::unifiedserve::check_msg(__VA_ARGS__))
