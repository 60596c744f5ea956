#!/bin/sh
# The compiler launcher of a wheel build (CMakeLists.txt,
# CKPTFS_BUILD_PROGRESS): `build_progress.sh SOURCE_DIR COMPILER ARGS...`
# names the file being compiled on the terminal, which pip leaves alone
# while it hides the build's output, then runs the compiler. Nothing is
# written where there is no terminal (CI, a pipe).
root=$1
shift
for arg in "$@"; do
  case "${prev:-}" in -c) source=$arg ;; esac
  prev=$arg
done
if [ -n "${source:-}" ] && (: >/dev/tty) 2>/dev/null; then
  printf 'ckptfs build: compiling %s\n' "${source#"$root"/}" >/dev/tty 2>/dev/null
fi
exec "$@"
