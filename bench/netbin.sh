#!/usr/bin/env bash
# iproute2 (`ip`, `tc`) for a GPU machine whose image has none: this machine's binaries and the
# libraries they need beyond glibc, into .netbin/ (git-ignored; carry it). bench/gpu_links.py puts
# .netbin/bin on PATH; each wrapper runs its binary through the loader with .netbin/lib as the
# library path, which the processes it starts (`ip netns exec ... python`) do not inherit.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for tool in ip tc; do command -v "$tool" > /dev/null || { echo "bench/netbin.sh: no $tool here" >&2; exit 1; }; done
rm -rf .netbin && mkdir -p .netbin/bin .netbin/libexec .netbin/lib
LOADER=$(ldd "$(command -v ip)" | awk '/ld-linux/ {print $1}')
for tool in ip tc; do
  cp "$(command -v "$tool")" .netbin/libexec/
  # every library but glibc's own (libc, libm, the loader, vdso): the GPU machine has a newer glibc
  ldd "$(command -v "$tool")" | awk '$3 ~ /^\// {print $3}' | grep -Ev '/(libc|libm|libz)\.so' | while read -r lib; do
    cp -L "$lib" .netbin/lib/
  done
  cat > ".netbin/bin/$tool" <<EOS
#!/bin/sh
d=\$(cd "\$(dirname "\$0")/.." && pwd)
exec $LOADER --library-path "\$d/lib" "\$d/libexec/$tool" "\$@"
EOS
  chmod +x ".netbin/bin/$tool"
done
echo "bench/netbin.sh: $(du -sh .netbin | cut -f1) in .netbin/ ($(ls .netbin/lib | tr '\n' ' '))"
