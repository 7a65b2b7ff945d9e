#!/usr/bin/env bash
# Prints an include directory with Vulkan headers 1.4 or newer, which ggml-vulkan needs
# (vk::LayerSettingEXT). The system's are used when new enough; otherwise (Debian 12 ships
# 1.3.239) Debian 13's libvulkan-dev is downloaded once with a private apt list, unpacked (not
# installed) under ~/.cache/river_gguf/vulkan-headers, and its include directory printed.
set -euo pipefail
is_14() { grep -qE 'VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION\(0, 1, ([4-9]|[1-9][0-9])' "$1/vulkan/vulkan_core.h" 2>/dev/null; }
if is_14 /usr/include; then echo /usr/include; exit 0; fi
DIR=${RIVER_GGUF_VULKAN_HEADERS:-$HOME/.cache/river_gguf/vulkan-headers}
if ! is_14 "$DIR/root/usr/include"; then
  echo "== fetching Vulkan headers 1.4 (Debian 13's libvulkan-dev) into $DIR" >&2
  rm -rf "$DIR" && mkdir -p "$DIR/lists/partial" "$DIR/cache"
  echo "deb http://deb.debian.org/debian trixie main" > "$DIR/sources.list"
  APT=(-q -o Dir::Etc::SourceList="$DIR/sources.list" -o Dir::Etc::SourceParts=/dev/null
       -o Dir::State::Lists="$DIR/lists" -o Dir::Cache="$DIR/cache" -o APT::Sandbox::User=root)
  apt-get "${APT[@]}" update >&2
  (cd "$DIR" && apt-get "${APT[@]}" download libvulkan-dev >&2)
  dpkg -x "$DIR"/libvulkan-dev_*.deb "$DIR/root"
  is_14 "$DIR/root/usr/include" || { echo "the downloaded libvulkan-dev has no 1.4 headers" >&2; exit 1; }
fi
echo "$DIR/root/usr/include"
