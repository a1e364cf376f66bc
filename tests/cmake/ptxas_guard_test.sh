#!/usr/bin/env bash
# cmake/ptxas_guard.sh against stand-in compilers: a clean compile passes with ptxas's info lines
# dropped and other messages kept, a compile whose ptxas reports serialised wgmma fails, and a
# failing compile keeps its exit code.
set -u
guard=$1
fail=0
check() {  # name, expected exit code, expected stderr pattern (or ""), forbidden stderr pattern (or ""), command...
  local name=$1 want=$2 has=$3 hasnt=$4
  shift 4
  local err rc
  err=$("$guard" "$@" 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" -ne "$want" ]; then echo "FAIL $name: exit $rc, expected $want"; fail=1; fi
  if [ -n "$has" ] && ! grep -q -- "$has" <<<"$err"; then echo "FAIL $name: stderr lacks '$has': $err"; fail=1; fi
  if [ -n "$hasnt" ] && grep -q -- "$hasnt" <<<"$err"; then echo "FAIL $name: stderr has '$hasnt': $err"; fail=1; fi
}
info='ptxas info    : Used 255 registers, used 7 barriers, 72 bytes cumulative stack size'
c7519="ptxas info    : (C7519) warpgroup.arrive is injected in around line 10 by compiler to allow use of registers in GMMA in function 'k'"
c7520="ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program dependence on compiler-inserted WG.AR in divergent path in the function 'k'"
check clean 0 "" "ptxas info" bash -c "echo '$info' >&2; echo '$c7519' >&2; echo '    72 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads' >&2"
check warning-kept 0 "warning: something" "" bash -c "echo 'x.cu(3): warning: something' >&2; echo '$info' >&2"
check serialised 1 "serialised wgmma" "" bash -c "echo '$info' >&2; echo '$c7520' >&2"
check serialised-named 1 "C7520" "" bash -c "echo '$c7520' >&2"
check compile-error 2 "error: bad" "" bash -c "echo 'x.cu(1): error: bad' >&2; exit 2"
[ $fail -eq 0 ] && echo "ptxas_guard: all checks passed"
exit $fail
