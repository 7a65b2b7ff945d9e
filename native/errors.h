// Exception types the Python module maps to clear Python exceptions.
#pragma once
#include <stdexcept>
#include <string>

namespace river {

// The file is not a readable GGUF (bad magic, corrupt header, truncated data).
struct GgufFormatError : std::runtime_error { using std::runtime_error::runtime_error; };
// A readable GGUF whose architecture or tensors this engine cannot run.
struct UnsupportedModelError : std::runtime_error { using std::runtime_error::runtime_error; };
// A backbone and a river that do not describe the same model.
struct RiverMismatchError : std::runtime_error { using std::runtime_error::runtime_error; };
// More tokens than the KV cache has room for.
struct ContextOverflowError : std::runtime_error { using std::runtime_error::runtime_error; };

}  // namespace river
