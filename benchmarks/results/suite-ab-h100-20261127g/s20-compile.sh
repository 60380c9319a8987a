# x1, carry .device/base .device/s20-compile.sh. Issue 38: MACE-MP-medium and NequIP compiled in a first and a second
# process (session 19 measured the bundled MACE only: 22.1 s, then 4.8 s).
set -o pipefail
L=$OUT/log.txt
source .device/base/env.sh > $L 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
OUT=$OUT timeout 540 python3 benchmarks/bench_compile.py --models mace-mp-medium,bundled-nequip >> $L 2>&1
grep -E "^(mace-mp-medium|bundled-nequip) " $L
