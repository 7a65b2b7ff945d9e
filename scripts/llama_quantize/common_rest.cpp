// The two functions llama-quantize takes from llama.cpp's common library that are not in the
// files scripts/build_llama_quantize.sh compiles from the pinned source (the logger, its JSON
// writer, the imatrix loader): compiling common.cpp for them would pull in the sampler, the
// speculative decoder and the chat code. This build of the tool refuses --override-kv (the tests
// never pass it) and does not colour its log.
#include "common.h"

#include <cstdio>
#include <vector>

bool string_parse_kv_override(const char * data, std::vector<llama_model_kv_override> & /*overrides*/) {
    std::fprintf(stderr, "--override-kv %s: not supported by this build of llama-quantize "
                         "(scripts/build_llama_quantize.sh); use scripts/build_llama_tools.sh's\n", data);
    return false;
}

bool tty_can_use_colors() {
    return false;
}
