// The table of architecture families (arch.h): one entry per family file in this folder.
#include <algorithm>

#include "../arch.h"

namespace river {

extern const ArchSpec kLlama, kQwen2, kQwen3, kGranite, kOlmo2, kGemma2, kGemma3, kPhi3, kMistral3;

const std::vector<const ArchSpec*>& arch_specs() {
    static const std::vector<const ArchSpec*> specs = {&kLlama,  &kQwen2,  &kQwen3, &kGranite, &kOlmo2,
                                                      &kGemma2, &kGemma3, &kPhi3,  &kMistral3};
    return specs;
}

const ArchSpec* find_arch(const std::string& name) {
    const auto& specs = arch_specs();
    auto it = std::find_if(specs.begin(), specs.end(), [&](const ArchSpec* a) { return name == a->name; });
    return it == specs.end() ? nullptr : *it;
}

}  // namespace river
