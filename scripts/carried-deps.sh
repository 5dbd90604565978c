# Sourced by the device scripts: PCRE2 carried in .deps/pcre2 (scripts/device-deps) when
# the machine has none — points pkg-config at a copy of its .pc file whose prefix is the
# unpacked tree.
if ! pkg-config --exists libpcre2-8 2>/dev/null && [ -d .deps/pcre2 ]; then
  pc_dir=$(mktemp -d)
  sed "s|^prefix=.*|prefix=$PWD/.deps/pcre2/usr|" .deps/pcre2/usr/lib/x86_64-linux-gnu/pkgconfig/libpcre2-8.pc \
    > "$pc_dir/libpcre2-8.pc"
  export PKG_CONFIG_PATH="$pc_dir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
fi
