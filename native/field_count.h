// The number of fields of an aggregate, for compile-time checks that a hand-written list of a
// struct's fields is whole (GraphSpec::key(), the layer slots): the most values that convert to
// anything it can be brace-initialised with. Unlike a list written by hand, it cannot miss a field.
#pragma once
#include <cstddef>
#include <type_traits>
#include <utility>

namespace river {

namespace field_count_detail {
struct AnyField {
    template <class T>
    operator T() const;  // only named in unevaluated contexts
};

template <class T, class... A>
auto brace_initialisable(int) -> decltype(T{std::declval<A>()...}, std::true_type{});
template <class T, class... A>
std::false_type brace_initialisable(...);
}  // namespace field_count_detail

template <class T, class... A>
constexpr size_t field_count() {
    using field_count_detail::AnyField;
    if constexpr (decltype(field_count_detail::brace_initialisable<T, A..., AnyField>(0))::value) {
        return field_count<T, A..., AnyField>();
    } else {
        return sizeof...(A);
    }
}

}  // namespace river
