#!/bin/bash
# Dumps PTX, ptxas report and SASS of the prefill forward kernel (GPU machine).
# Usage (on the GPU machine): bash benchmarks/experiments/sass_dump.sh <out_dir>
# Env: CHAIN_IN_WGMMA, as for dump_ptxas.sh.
set -u
out=${1:-/tmp/sass}
mkdir -p "$out/mosaic"
bash benchmarks/experiments/dump_ptxas.sh "$out/mosaic" > "$out/dump.log" 2>&1
ptx=$(ls "$out"/mosaic/*.ptx | head -1)
PTXAS=$(command -v ptxas || ls /usr/local/cuda*/bin/ptxas 2>/dev/null | head -1)
CUOBJ=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
echo "ptxas=$PTXAS cuobjdump=$CUOBJ"
"$PTXAS" -arch=sm_90a -O3 -v "$ptx" -o "$out/k.cubin" 2>&1 | tail -5
"$CUOBJ" -sass "$out/k.cubin" > "$out/k.sass" 2>&1
wc -l "$out/k.sass"
grep -c "HGMMA" "$out/k.sass"; grep -c "WARPGROUP.DEPBAR" "$out/k.sass"; grep -c "WARPGROUP.ARRIVE" "$out/k.sass"
cp "$ptx" "$out/k.ptx"; rm -rf "$out/mosaic"; gzip -f "$out/k.sass" "$out/k.ptx"
