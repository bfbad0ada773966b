#include "core/error.hpp"

namespace fp8 {

namespace {
thread_local std::string t_last_error;
thread_local const char* t_static_error = nullptr;  // wins while set: the string could not be built
}  // namespace

void set_last_error(const std::string& message) {
  t_last_error = message;
  t_static_error = nullptr;
}
void set_last_error_static(const char* message) noexcept { t_static_error = message; }
const char* last_error() { return t_static_error ? t_static_error : t_last_error.c_str(); }

}  // namespace fp8
