// Errors inside the library are C++ exceptions carrying a status; src/api turns them into
// fp8_status_t plus the per-thread message, so none crosses the C boundary.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "fp8.h"

namespace fp8 {

class Error : public std::runtime_error {
 public:
  Error(fp8_status_t status, const std::string& message) : std::runtime_error(message), status_(status) {}
  fp8_status_t status() const noexcept { return status_; }

 private:
  fp8_status_t status_;
};

// fail(FP8_ERR_SHAPE, "in has ", n, " columns, expected ", m): builds the message from its parts.
template <typename... Parts>
[[noreturn]] void fail(fp8_status_t status, Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  throw Error(status, os.str());
}

// Throws FP8_ERR_INVALID_ARGUMENT naming `name` when `p` is NULL.
template <typename T>
void require_arg(const T* p, const char* name) {
  if (p == nullptr) fail(FP8_ERR_INVALID_ARGUMENT, "argument '", name, "' is NULL");
}

// The per-thread message behind fp8_last_error_message().
void set_last_error(const std::string& message);
void set_last_error_static(const char* message) noexcept;  // no allocation
const char* last_error();

}  // namespace fp8
