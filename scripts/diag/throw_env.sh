#!/usr/bin/env bash
# Why does a C++ error raised inside an afd_ext op kill the process on this
# machine? Prints the toolchain facts and a native backtrace of the crash.
# Run from the repository root after the build; logs to stdout.
set -u
unset PYTHONFAULTHANDLER
PY=${PY:-python3}
echo "--- toolchain"; g++ --version | head -1; ld --version | head -1
$PY - <<'PYEOF'
import torch, sys, glob
print("torch", torch.__version__, "abi", torch._C._GLIBCXX_USE_CXX11_ABI)
cfg = torch.__config__.show()
print("\n".join(l for l in cfg.splitlines() if "GCC" in l or "clang" in l.lower() or "CXX_COMPILER" in l or "CXX_FLAGS" in l)[:3000])
PYEOF
echo "--- libstdc++ the compiler links: $(g++ -print-file-name=libstdc++.so) / $(g++ -print-file-name=libstdc++.so.6)"
ls -la "$(g++ -print-file-name=libstdc++.so)" 2>&1
SO=$(ls afd_ext/_C*.so | head -1); echo "--- ldd $SO"; ldd "$SO"; ls -la "$SO"
echo "--- C++ runtime code defined inside $SO (0 expected):"
nm -D --defined-only "$SO" | c++filt | grep -c "std::basic_ostream\|codecvt\|std::locale"
echo "--- libstdc++ in a torch process"
$PY -c "import torch, afd_ext.ops; print(open('/proc/self/maps').read())" | grep -o '/[^ ]*libstdc++[^ ]*\|/[^ ]*libgcc_s[^ ]*' | sort -u
gcc -shared -fPIC -O0 -g -o /tmp/segv_trace.so scripts/diag/segv_trace.c -ldl || exit 1
CODE="import torch, afd_ext.ops as o; o.pack_rows(torch.zeros(2, 4), None, None, torch.zeros(2, 3, dtype=torch.uint8))"
for show in 0 1; do
  echo "--- TORCH_SHOW_CPP_STACKTRACES=$show"
  TORCH_SHOW_CPP_STACKTRACES=$show LD_PRELOAD=/tmp/segv_trace.so $PY -c "$CODE" 2>&1 | tail -45; echo "rc=${PIPESTATUS[0]}"
done
echo "--- every libstdc++ archive / linker name on this machine (a -L dir holding libstdc++.a wins over the system .so)"
timeout 30 find / -xdev \( -name 'libstdc++.a' -o -name 'libstdc++.so' \) 2>/dev/null | head -20
