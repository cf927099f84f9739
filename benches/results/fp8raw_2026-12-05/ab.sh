# usage: bash ab.sh ROUNDS ARG SCRIPT A.so B.so ...
# Runs `python SCRIPT ARG` once per build per round, the builds of the native extension alternated
# (each copied over kernels/kvcore_kernels/_native.abi3.so first); at the end RESTORE (default:
# the last build named) is put back.
K=$(git rev-parse --show-toplevel)/kernels/kvcore_kernels
R=$1; T=$2; S=$3; shift 3
for r in $(seq "$R"); do for v in "$@"; do
cp "$v" "$K/_native.tmp" && mv "$K/_native.tmp" "$K/_native.abi3.so"
echo "$(basename "$v") $(python "$S" "$T")"
done; done
last=${*: -1}
cp "${RESTORE:-$last}" "$K/_native.tmp" && mv "$K/_native.tmp" "$K/_native.abi3.so"
