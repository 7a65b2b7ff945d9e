#include <stdexcept>
#include <string>

#include "exit_rule.h"

namespace river {

// Each rule is defined in its own file under exit_rules/.
extern const ExitRule kCosineExit;

const std::vector<const ExitRule*>& exit_rules() {
    static const std::vector<const ExitRule*> rules = {
        &kCosineExit,  // code 0: the default
    };
    return rules;
}

const ExitRule& exit_rule(int code) {
    const auto& rules = exit_rules();
    if (code < 0 || static_cast<size_t>(code) >= rules.size()) {
        throw std::invalid_argument("exit rule " + std::to_string(code) + " is not one of the " +
                                    std::to_string(rules.size()) + " rules");
    }
    return *rules[code];
}

}  // namespace river
