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
# What ptxas -v prints (the serialisation report as ptxas words it), and stand-in compilers that
# print lines to stderr and exit with a given code.
info='ptxas info    : Used 255 registers, used 7 barriers, 72 bytes cumulative stack size'
stack='    72 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads'
c7519="ptxas info    : (C7519) warpgroup.arrive is injected in around line 10 by compiler to allow use"
c7519+=" of registers in GMMA in function 'k'"
c7520="ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized"
c7520+=" due to program dependence on compiler-inserted WG.AR in divergent path in the function 'k'"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
stand_in() {  # exit code, lines...: a script that prints the lines to stderr and exits with the code
  local f
  f=$(mktemp "$tmp/compiler.XXXX")
  { echo "#!/usr/bin/env bash"; printf 'printf "%%s\\n"'; printf " %q" "${@:2}"; printf ' >&2\nexit %s\n' "$1"; } > "$f"
  chmod +x "$f"
  echo "$f"
}
check clean 0 "" "ptxas info" "$(stand_in 0 "$info" "$c7519" "$stack")"
check warning-kept 0 "warning: something" "" "$(stand_in 0 'x.cu(3): warning: something' "$info")"
check serialised 1 "serialised wgmma" "" "$(stand_in 0 "$info" "$c7520")"
check serialised-named 1 "C7520" "" "$(stand_in 0 "$c7520")"
check compile-error 2 "error: bad" "" "$(stand_in 2 'x.cu(1): error: bad')"
[ $fail -eq 0 ] && echo "ptxas_guard: all checks passed"
exit $fail
