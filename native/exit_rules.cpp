#include <stdexcept>
#include <string>

#include "exit_rule.h"
#include "exit_setting.h"

namespace river {

// Each rule is defined in its own file under exit_rules/.
extern const ExitRule kCosineExit;
extern const ExitRule kUpdateExit;

const std::vector<const ExitRule*>& exit_rules() {
    static const std::vector<const ExitRule*> rules = [] {
        std::vector<const ExitRule*> r = {
            &kCosineExit,  // code 0: the default
            &kUpdateExit,
        };
        if (ExitSetting{}.threshold != never_exit_threshold(*r[0])) {
            throw std::logic_error("ExitSetting's default threshold must be never_exit_threshold of rule 0");
        }
        return r;
    }();
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

int exit_rule_code(const std::string& name) {
    const auto& rules = exit_rules();
    for (size_t i = 0; i < rules.size(); ++i) {
        if (name == rules[i]->name) return static_cast<int>(i);
    }
    return -1;
}

std::string exit_rule_names() {
    std::string s;
    for (const ExitRule* r : exit_rules()) s += (s.empty() ? "" : ", ") + std::string(r->name);
    return s;
}

}  // namespace river
